"""``espalier generate --local``: the in-process engine from the command line.

Bad flags end with one line on stderr and status 2 (no traceback); on the embedded model, the
speculative run prints the same tokens as the plain one, a valid instance, and its stats.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from espalier.server.main import main

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--model", "/no/such/model"],
            "/no/such/model: neither an HF model directory nor a .gguf",
        ),
        (["--device", "bogus"], "--device bogus: not a device"),
        (["--device", "mps"], "--device mps: only cpu and cuda are supported"),
    ],
)
def test_bad_flags_are_one_line_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--local", *flags, "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("espalier generate: ") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_an_unknown_dtype_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--local", "--dtype", "int8", "Hello"])
    assert info.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def _generate(schema: Path, speculative: str, capsys: pytest.CaptureFixture[str]) -> Any:
    args = ["generate", "--local", "--schema", str(schema), "--max-tokens", "40", "--json"]
    assert main([*args, "--speculative", speculative, "A person as JSON: "]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.model
def test_speculative_local_generation_matches_plain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    plain = _generate(schema, "off", capsys)
    spec = _generate(schema, "ngram,forced", capsys)
    assert spec["token_ids"] == plain["token_ids"]  # greedy speculation is lossless
    assert spec["text"] == plain["text"]
    value = json.loads(spec["text"])
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 150
    assert spec["validation"] == {"checked": True, "valid": True, "errors": []}
    assert plain["speculative"] is None
    stats = spec["speculative"]
    assert stats["steps"] >= 1 and stats["verify_s"] > 0
    assert stats["accepted_tokens"] <= stats["draft_tokens"]
