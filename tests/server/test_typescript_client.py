"""The TypeScript client's own test (node:test against a server it spawns), installed with
``npm ci`` from its lockfile: CI runs from a fresh clone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"


@pytest.mark.skipif(shutil.which("npm") is None, reason="node/npm is not installed")
def test_typescript_client_against_a_live_server() -> None:
    env = dict(os.environ, ESPALIER_PYTHON=sys.executable)
    if not (PACKAGE / "node_modules" / ".package-lock.json").exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=PACKAGE, env=env, check=True, timeout=600
        )
    done = subprocess.run(
        ["npm", "test"], cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "# fail 0" in done.stdout
