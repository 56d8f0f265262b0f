"""The tokenizer bundle SMG's ``GetTokenizer`` streams: a zip of a Hugging Face tokenizer folder.

SMG builds its own tokenizer and chat-template renderer from these files (``tokenizer.json``,
``tokenizer_config.json`` with ``chat_template``, ``chat_template.jinja``, the special-token map).
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Kept below SMG's per-message limits (its own servicers stream 64 KiB).
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class TokenizerBundle:
    """``data``: the zip archive's bytes; ``sha256``: their hex digest (sent on the last chunk)."""

    data: bytes
    sha256: str

    def chunks(self) -> Iterator[tuple[bytes, str]]:
        """(bytes, sha256 on the last chunk else "") pieces of at most CHUNK_BYTES."""
        total = len(self.data)
        for start in range(0, total, CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, total)
            yield self.data[start:end], self.sha256 if end == total else ""


def build_bundle(hf_tokenizer: Any, stop_token_ids: Sequence[int]) -> TokenizerBundle:
    """Save ``hf_tokenizer`` (a transformers tokenizer) and zip every file it wrote, with a
    ``generation_config.json`` naming ``stop_token_ids`` as ``eos_token_id``.

    SMG strips the EOS ids it reads from that file before it detokenizes; without them a stop
    token the engine sampled (Gemma's ``<end_of_turn>``) was written into the reply's text
    wherever SMG keeps special tokens (tool calls on: ``{"ok": false}<end_of_turn>`` with
    finish ``stop``). Blocking (hundreds of ms for a 262k vocabulary): call it off the event
    loop, once.
    """
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="espalier-tokenizer-") as folder:
        hf_tokenizer.save_pretrained(folder)
        generation = {"eos_token_id": sorted(set(stop_token_ids))}
        (Path(folder) / "generation_config.json").write_text(json.dumps(generation))
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(folder).iterdir()):
                if path.is_file():
                    archive.write(path, path.name)
    data = buffer.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest())
