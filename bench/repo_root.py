"""The repository root on ``sys.path``, for bench scripts that use the test fixtures
(``tests.fixtures``: random draft trees, the tree-mask oracle). Import it before them."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after the script's own folder (bench/)
