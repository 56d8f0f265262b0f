"""``espalier generate --schema FILE``: a bad input file is one clear line and status 2, remote
and local alike (checked before any connection or model load)."""

from __future__ import annotations

from pathlib import Path

import pytest

from espalier.server.main import main


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"type": "object", ', "not valid JSON at line 1, column 20"),
        ("[" * 100_000, "nested too deeply"),
        (None, "cannot read it"),
    ],
)
def test_a_bad_schema_file_is_one_line_and_status_2(
    tmp_path: Path,
    local: bool,
    content: str | None,
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    where = ["--local"] if local else ["--address", "127.0.0.1:1"]
    assert main(["generate", *where, "--schema", str(path), "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"espalier generate: --schema {path}: ") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1
