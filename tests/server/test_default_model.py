"""``--model default``: resolved to the embedded GGUF here in server/ (the grammar layer and the
engine take an HF directory or a ``.gguf`` path and never import the embedded-model package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from espalier.server.default_model import (
    DEFAULT_MODEL,
    default_gguf,
    default_tokenizer,
    resolve_model,
)


def test_other_names_pass_through(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("model.gguf") == "model.gguf"
    assert resolve_model("tiny-random") == "tiny-random"


@pytest.mark.model
def test_default_is_the_embedded_gguf() -> None:
    path = Path(resolve_model(DEFAULT_MODEL))
    assert path.suffix == ".gguf" and path.is_file()
    assert path == default_gguf()


@pytest.mark.model
def test_default_tokenizer_is_one_per_process(gemma_tokenizer: Any) -> None:
    assert default_tokenizer() is gemma_tokenizer
    assert gemma_tokenizer.name == f"gguf:{default_gguf().name}"
