#!/usr/bin/env bash
# Set up (if needed) and run the test suite, lint and type checks. Fails on any failure.
# ESPALIER_SLOW=1 also runs the slow suites in full.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check constrained
.venv/bin/mypy constrained
export TRITON_INTERPRET=1
.venv/bin/python -m pytest -q "$@"
