#!/usr/bin/env bash
# Create .venv (if missing) and install espalier, its dev tools and the Python SDK. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's notes about this machine's local package index are noise; real errors still fail the script.
pipq() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored" >&2); }
pipq --upgrade pip
# CPU build of torch from the local wheel first: an unpinned torch would pull a multi-GB CUDA build.
pipq torch==2.13.0
pipq -e ".[dev,gateway]"
# The Python SDK (its own package; `espalier generate` and tests/server use it).
pipq -e clients/python
.venv/bin/python -c "import torch, espalier.constrained, espalier.v1.espalier_pb2, espalier_client"
# The native llguidance walk was built by the install above (setup.py); check it loads against
# the installed llguidance (version and struct layout).
.venv/bin/python -c "from espalier.constrained.backends.llguidance.native.capi import api; api()"
# The duplicate-key tracker (constrained/keys/keys.c), built by the same install: check its ABI.
.venv/bin/python -c "from espalier.constrained.keys.native import lib; lib()"
.venv/bin/smg --version >/dev/null
