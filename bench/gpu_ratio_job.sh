#!/usr/bin/env bash
# Issue 28's done-when on the H200 in one device call: bench/gpu.py's equal-work constrained /
# unconstrained ratios (plain and speculative, oracle drafts, closing on unless EXTRA=--no-closing,
# REPS ABBA reps) per RUNS entry "TREE:BATCHES": TREE is new (this tree) or a folder beside bench/
# holding another tree (base = `git archive b2525ec`, the issue's anchor; alt = an experiment);
# then, optionally, bench/gpu_timeline.py (TIMELINE="flags") and bench/serve.py (SERVE="flags",
# tiny-random over the Gemma tokenizer folder).
# Layout, in a copy of the tree (e.g. .gpu/, git-ignored, carried with the root's .whl/ from
# ../shared/gpu/wheels.sh): .data/whl/ (the extra wheels the suite needs), .data/gemma_tok/
# (tokenizer.json.gz), .data/jsonschemabench.tar.xz, .data/fi/fi.tar.xz.* (flashinfer's JIT cache,
# bench/gpu_suite_job.sh writes it). Example:
#   cd .gpu && RUNS="new:32 base:32 new:1" LIMIT=200 bash bench/gpu_ratio_job.sh
set -u
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ../.whl/*.whl .data/whl/*.whl 2>/dev/null
find /tmp/site -exec touch -h -d '2020-01-01 00:00' {} + 2>/dev/null
[ -d .data/jsonschemabench ] || tar -xJf .data/jsonschemabench.tar.xz -C .data
[ -f .data/gemma_tok/tokenizer.json ] || gunzip -k .data/gemma_tok/tokenizer.json.gz
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
[ -d /tmp/fiws/.cache ] || { mkdir -p /tmp/fiws && cat .data/fi/fi.tar.xz.* | tar -xJ -C /tmp/fiws && echo "jit cache restored"; }
( python3 setup.py -q build_ext --inplace > $OUT/build.log 2>&1; [ ! -f alt/setup.py ] || (cd alt && python3 setup.py -q build_ext --inplace >> $OUT/build.log 2>&1) ); echo "build rc $? at $(( $(date +%s) - t0 )) s"
here=$PWD
[ -e base/.data ] || ln -s ../.data base/.data
mkdir -p /tmp/pk/new /tmp/pk/base
ln -sfn "$here" /tmp/pk/new/espalier; for t in base alt; do [ -d "$t" ] || continue; mkdir -p /tmp/pk/$t; ln -sfn "$here/$t" /tmp/pk/$t/espalier; [ -e $t/.data ] || ln -s ../.data $t/.data; done
nproc; cat /proc/loadavg
n=0
for run in ${RUNS-new:32}; do
  n=$((n + 1)); tree=${run%%:*}; batches=${run#*:}
  dir=$here; [ "$tree" != new ] && dir=$here/$tree
  tag="${tree}_b${batches//,/_}_$n"; start=$(date +%s)
  (cd "$dir" && PYTHONPATH=/tmp/site:/tmp/pk/$tree timeout ${LIMIT:-280} python3 bench/gpu.py \
     --tokenizer $here/.data/gemma_tok --skip-decode --spec-batches $batches --spec-reps ${REPS:-3} \
     --profile-batch 0 ${EXTRA:-} > $OUT/$tag.jsonl 2> $OUT/$tag.err)
  echo "$tag rc $? in $(( $(date +%s) - start )) s"; tail -n 2 $OUT/$tag.err | cut -c1-300
  python3 - $OUT/$tag.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try: d = json.loads(line)
    except Exception: continue
    flat = {k: v for k, v in d.items() if not isinstance(v, (dict, list))}
    if d.get("part") == "spec_equal_work" or "constrained_over_unconstrained_speculative" in d or "summary" in str(d.get("part")):
        print(json.dumps(flat)[:700])
PY
done
if [ -n "${TIMELINE:-}" ]; then
  (PYTHONPATH=/tmp/site:/tmp/pk/new timeout ${LIMIT:-280} python3 bench/gpu_timeline.py --tokenizer $here/.data/gemma_tok \
    --skip-decode --spec-batches 32 --spec-reps ${REPS:-3} --profile-batch 0 $TIMELINE > $OUT/timeline.jsonl 2> $OUT/timeline.err)
  echo "timeline rc $?"; tail -n 2 $OUT/timeline.err | cut -c1-300
  python3 - $OUT/timeline.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if "constrained_over_unconstrained_speculative" in d:
        print("RATIO", {k: v for k, v in d.items() if not isinstance(v, (dict, list))})
    elif d.get("part") == "timeline":
        ms = d["ms_per_step"]
        print("TL c=%s s=%s tok/s=%s" % (d["constrained"], d["speculative"], d["tok_per_s"]),
              {k: round(v, 2) for k, v in ms.items() if isinstance(v, (int, float)) and v >= 0.05})
PY
fi
if [ -n "${SERVE:-}" ]; then
  [ -e v1 ] || ln -s proto/espalier/v1 v1
  start=$(date +%s)
  PYTHONPATH=/tmp/site:/tmp/pk/new:$here/clients/python:$here timeout ${SERVE_LIMIT:-300} python3 bench/serve.py \
    --model tiny-random --tokenizer $here/.data/gemma_tok $SERVE > $OUT/serve.jsonl 2> $OUT/serve.err
  echo "serve rc $? in $(( $(date +%s) - start )) s"; grep -v "^ - \|nanobind\|leaked" $OUT/serve.err | grep -v '"event": "request"' | tail -n 5 | cut -c1-300
  cut -c1-600 $OUT/serve.jsonl
fi
echo "done at $(( $(date +%s) - t0 )) s"
