"""The tokenizer bundle SMG's ``GetTokenizer`` streams: a zip of a Hugging Face tokenizer folder.

SMG builds its own tokenizer and chat-template renderer from these files (``tokenizer.json``,
``tokenizer_config.json`` with ``chat_template``, ``chat_template.jinja``, the special-token map).
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import zipfile
from collections.abc import Iterator
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


def build_bundle(hf_tokenizer: Any) -> TokenizerBundle:
    """Save ``hf_tokenizer`` (a transformers tokenizer) and zip every file it wrote.

    Blocking (hundreds of ms for a 262k vocabulary): call it off the event loop, once.
    """
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="espalier-tokenizer-") as folder:
        hf_tokenizer.save_pretrained(folder)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(folder).iterdir()):
                if path.is_file():
                    archive.write(path, path.name)
    data = buffer.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest())
