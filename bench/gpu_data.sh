#!/usr/bin/env bash
# Build .gpu/ (git-ignored) for bench/gpu_ratio_job.sh and bench/gpu_suite_job.sh: a copy of this
# tree's tracked files, base/ (`git archive b2525ec`, issue 28's anchor) and .data/ (the Gemma
# tokenizer converted from the embedded GGUF, JSONSchemaBench from ../shared, lark in .data/whl),
# and the root's .whl/ (../shared/gpu/wheels.sh plus what SERVE's server process needs). Run from
# a checkout with scripts/setup.sh done; again after each change (the copy is refreshed, .data is
# kept). Then, on the GPU machine, with carry [".whl", ".gpu"]:
#   cd .gpu && RUNS="new:32 base:32" REPS=3 LIMIT=200 bash bench/gpu_ratio_job.sh
# flashinfer's JIT cache (.data/fi/) is optional: without it the first run compiles (about a
# minute on the H200).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/.data/gemma_tok .gpu/.data/whl
if [ ! -f .gpu/.data/gemma_tok/tokenizer.json.gz ]; then
  tok=$(.venv/bin/python -c "from espalier.server.default_model import default_gguf
from espalier.constrained.tokenizer import converted_gguf_tokenizer_dir
print(converted_gguf_tokenizer_dir(default_gguf()))")
  cp "$tok"/* .gpu/.data/gemma_tok/
  gzip -f .gpu/.data/gemma_tok/tokenizer.json
fi
[ -f .gpu/.data/jsonschemabench.tar.xz ] || cp ../shared/conformance/jsonschemabench.tar.xz .gpu/.data/
if [ ! -d .whl ] || [ -z "$(ls .whl/grpcio-* 2>/dev/null)" ]; then
  # the generated gRPC code needs grpcio >= 1.85.1 (the machine has 1.84); the rest is the
  # server's post-validation (jsonschema's format checkers)
  bash ../shared/gpu/wheels.sh grpcio regex jsonschema-rs fqdn idna isoduration arrow jsonpointer \
    rfc3339-validator rfc3986-validator rfc3987-syntax uri-template webcolors python-dateutil
fi
# lark (the Lark grammar front end) in .data/whl only: the jobs install both folders, and a wheel
# in both is a pip error that leaves the machine without any of them
rm -f .whl/lark-*.whl
[ -n "$(ls .gpu/.data/whl/lark-*.whl 2>/dev/null)" ] || .venv/bin/python -m pip download -q \
  --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/.data/whl lark
# pytest for bench/gpu_suite_job.sh (the machine has none)
[ -n "$(ls .gpu/.data/whl/pytest-*.whl 2>/dev/null)" ] || .venv/bin/python -m pip download -q \
  --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/.data/whl pytest pluggy iniconfig \
  packaging
find .gpu -mindepth 1 -maxdepth 1 ! -name .data -exec rm -rf {} +
git ls-files -z | xargs -0 cp --parents -t .gpu
mkdir -p .gpu/base && git archive b2525ec | tar -x -C .gpu/base
du -sh .gpu .whl
