#!/usr/bin/env bash
# Create .venv (if missing) and install espalier with its dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# CPU build of torch from the local wheel first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch" 
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -vE "is ignored|^\s*$|!!|\*\*\*|with strategy|warnings.warn|SetuptoolsDeprecation|setuptools|See https|By 20|Please|########|^\s+\^" || true
.venv/bin/python -c "import espalier.constrained, xgrammar, llguidance, outlines_core" 
