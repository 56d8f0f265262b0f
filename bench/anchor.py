"""The same bench under another checkout's code, for a comparison in one run (STYLE 12)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_anchor(root: str | Path, script: str, args: Sequence[str]) -> dict[str, Any]:
    """The last JSON line of ``script`` run with ``args`` and ``--json-only`` by checkout
    ``root``'s interpreter (its ``.venv``: its code), in its folder; paths in ``args`` must be
    absolute."""
    root = Path(root).resolve()
    out = subprocess.run(
        [str(root / ".venv" / "bin" / "python"), script, *args, "--json-only"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    )
    record: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return record
