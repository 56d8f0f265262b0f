#!/usr/bin/env bash
# Issue 28's GPU measurements in one device call, per RUNS entry "TREE:BATCHES[:FLAGS]" (FLAGS:
# more flags of that run, joined by "+", e.g. new:32:--forced+--in-process-text; TREE: new = this
# tree, or a folder beside bench/ holding another tree: base = `git archive b2525ec`, the issue's
# anchor; alt = an experiment), run in turn: BENCH=gpu (default) is bench/gpu.py's equal-work
# constrained / unconstrained ratios (plain and speculative, oracle drafts, closing on unless
# EXTRA=--no-closing, REPS ABBA reps); BENCH=gpu_timeline is bench/gpu_timeline.py, the same runs
# with per-phase timers. Then, optionally, bench/serve.py on this tree (SERVE="flags",
# tiny-random over the Gemma tokenizer folder).
# Layout (bench/gpu_data.sh builds all of it), in a copy of the tree (e.g. .gpu/, git-ignored,
# carried with the root's .whl/ from
# ../shared/gpu/wheels.sh): .data/whl/ (the extra wheels the suite needs), .data/gemma_tok/
# (tokenizer.json.gz), .data/jsonschemabench.tar.xz, .data/fi/fi.tar.xz.* (flashinfer's JIT cache,
# bench/gpu_suite_job.sh writes it). The root's .whl/ for SERVE: `../shared/gpu/wheels.sh grpcio
# regex jsonschema-rs fqdn idna isoduration arrow jsonpointer rfc3339-validator rfc3986-validator
# rfc3987-syntax lark uri-template webcolors python-dateutil` (the generated gRPC code needs
# grpcio >= 1.85.1, the machine has 1.84; the server's post-validation needs the rest: without
# them SERVE's constrained phase fails). Examples:
#   cd .gpu && RUNS="new:32 base:32 new:1" LIMIT=200 bash bench/gpu_ratio_job.sh
#   cd .gpu && BENCH=gpu_timeline RUNS="new:32 base:32" EXTRA=--no-closing bash bench/gpu_ratio_job.sh
#   cd .gpu && RUNS= SERVE="--streams 64 --max-tokens 64 --reps 3 --kv-blocks 4096 --requests-per-stream 4" bash bench/gpu_ratio_job.sh
#     (issue 28's served/offline: docs/decisions/serve-closed-loop.md)
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
mkdir -p /tmp/err  # stderr stays on the machine: the device returns at most 8 files of $OUT
mkdir -p /tmp/pk/new && ln -sfn "$here" /tmp/pk/new/espalier  # `import espalier` = a tree's root
for t in base alt; do
  [ -d "$t" ] || continue
  mkdir -p /tmp/pk/$t && ln -sfn "$here/$t" /tmp/pk/$t/espalier
  [ -e $t/.data ] || ln -s ../.data $t/.data
done
nproc; cat /proc/loadavg
n=0
for run in ${RUNS-new:32}; do
  n=$((n + 1)); tree=${run%%:*}; rest=${run#*:}; batches=${rest%%:*}
  flags=""; [ "$rest" != "$batches" ] && flags=${rest#*:}  # TREE:BATCHES:FLAGS (no spaces)
  flags=${flags//+/ }  # flags joined by "+": new:32:--forced+--in-process-text
  dir=$here; [ "$tree" != new ] && dir=$here/$tree
  tag="${tree}_b${batches//,/_}_$n"; start=$(date +%s)
  (cd "$dir" && PYTHONPATH=/tmp/site:/tmp/pk/$tree timeout ${LIMIT:-280} python3 bench/${BENCH:-gpu}.py \
     --tokenizer $here/.data/gemma_tok --skip-decode --spec-batches $batches --spec-reps ${REPS:-3} \
     --profile-batch 0 ${EXTRA:-} $flags > $OUT/$tag.jsonl 2> /tmp/err/$tag.err)
  echo "$tag rc $? in $(( $(date +%s) - start )) s"; tail -n 2 /tmp/err/$tag.err | cut -c1-300
  python3 - $OUT/$tag.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    flat = {k: v for k, v in d.items() if not isinstance(v, (dict, list))}
    if d.get("part") == "timeline":
        ms = d["ms_per_step"]
        print("TL c=%s s=%s tok/s=%s" % (d["constrained"], d["speculative"], d["tok_per_s"]),
              {k: round(v, 2) for k, v in ms.items() if isinstance(v, (int, float)) and v >= 0.05})
        counts = d.get("per_step_counts", {})
        print("   steps ms", d["per_step_ms"]["step"][:10], "rows", counts.get("rows", [])[:10],
              "eager", sum(counts.get("eager", [])),
              "compiled", d.get("compiled"))
        # the start (first 4 steps) apart from the rest: a constrained burst's gap is mostly
        # there (docs/decisions/start-of-burst.md); lag: verification's end after both the GPU
        # forward and the masks, summed; blocked: its voluntary context switches, summed
        steps, clock = d["per_step_ms"]["step"], d.get("clock_per_step_ms", {})
        lag = [v - max(g, m) for g, m, v in zip(clock.get("gpu_forward_end", []),
               clock.get("masks_ready", []), clock.get("verified", []))]
        blocked = counts.get("verify_blocked", [])
        print("   start4 %.1f ms rest %.1f ms | lag start4 %.1f rest %.1f | blocked %d / %d" % (
              sum(steps[:4]), sum(steps[4:]), sum(lag[:4]), sum(lag[4:]),
              sum(blocked[:4]), sum(blocked[4:])))
    elif "tok_per_s" in d:
        print("RUN c=%s s=%s tok/s=%.1f reps=%s steps=%s dropped=%s" % (
              d["constrained"], d["speculative"], d["tok_per_s"],
              [round(x, 1) for x in d.get("tok_per_s_reps", [])],
              d.get("engine_steps"), d.get("dropped_rows")))
    elif "constrained_over_unconstrained_speculative" in d or d.get("part") == "summary":
        print("RATIO", json.dumps(flat)[:700])
PY
done
if [ -n "${SERVE:-}" ]; then
  [ -e v1 ] || ln -s proto/espalier/v1 v1
  start=$(date +%s)
  PYTHONPATH=/tmp/site:/tmp/pk/new:$here/clients/python:$here timeout ${SERVE_LIMIT:-300} python3 bench/serve.py \
    --model tiny-random --tokenizer $here/.data/gemma_tok $SERVE > $OUT/serve.jsonl 2> /tmp/err/serve.err
  echo "serve rc $? in $(( $(date +%s) - start )) s"; grep -v "^ - \|nanobind\|leaked" /tmp/err/serve.err | grep -v '"event": "request"' | tail -n 5 | cut -c1-300
  cut -c1-1600 $OUT/serve.jsonl
fi
echo "done at $(( $(date +%s) - t0 )) s"
