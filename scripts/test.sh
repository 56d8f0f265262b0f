#!/usr/bin/env bash
# Set up (if needed) and run the test suite, lint and type checks. Fails on any failure.
# ESPALIER_SLOW=1 also runs the slow suites in full.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy needs to see the package-dir mapping: .typecheck/espalier links to the repo root.
mkdir -p .typecheck && ln -sfn .. .typecheck/espalier
MYPYPATH=.typecheck .venv/bin/mypy -p espalier.kernels -p espalier.constrained \
    -p espalier.engine -p espalier.server -p espalier.clients
.venv/bin/lint-imports
# Kernel tests run Triton through its interpreter on CPU (tests/kernels sets TRITON_INTERPRET=1).
.venv/bin/python -m pytest -q "$@"
