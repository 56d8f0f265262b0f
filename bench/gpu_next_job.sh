#!/usr/bin/env bash
# Issue 28's GPU job: bench/gpu_timeline.py (bench/gpu.py with per-phase timers: 8B-Llama shape,
# random bf16 weights, Gemma vocabulary, oracle drafts, closing on, ABBA reps) on this tree and on
# a copy of the anchor commit in ./base, alternating, in one machine session.
# Usage, from the root of a copy of this tree (with base/ beside bench/ and the Gemma tokenizer
# saved by ``espalier.server.default_model.default_tokenizer().hf.save_pretrained`` in .data/gemma_tok, tokenizer.json
# gzipped), after the wheel install line, with $OUT set:
#   bash bench/gpu_next_job.sh BATCHES REPS SECONDS_PER_RUN ORDER
#   e.g. bash bench/gpu_next_job.sh 32,64 3 280 new,base
set -u
batches=${1:-32,64}
reps=${2:-3}
limit=${3:-280}
order=${4:-new,base}
here=$PWD
mkdir -p /tmp/pk/new /tmp/pk/base
ln -sfn "$here" /tmp/pk/new/espalier  # `import espalier` is the repo root (pyproject's package-dir)
ln -sfn "$here/base" /tmp/pk/base/espalier
nproc; cat /proc/loadavg
[ -f .data/gemma_tok/tokenizer.json ] || gunzip -k .data/gemma_tok/tokenizer.json.gz
export PYTHONUNBUFFERED=1
args="--tokenizer $here/.data/gemma_tok --skip-decode --spec-batches $batches --spec-reps $reps --profile-batch 0"
n=0
for tree in ${order//,/ }; do
  n=$((n + 1))
  dir=$here; [ "$tree" = base ] && dir=$here/base
  tag="${tree}_b${batches//,/_}_$n"
  start=$(date +%s)
  (cd "$dir" && PYTHONPATH=/tmp/site:/tmp/pk/$tree timeout "$limit" python3 bench/gpu_timeline.py $args \
    > "$OUT/$tag.jsonl" 2> "$OUT/$tag.err")
  echo "$tag rc $? in $(( $(date +%s) - start )) s"
  tail -n 3 "$OUT/$tag.err"
  python3 - "$OUT/$tag.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    if "constrained_over_unconstrained_speculative" in d:
        print("RATIO", {k: v for k, v in d.items() if not isinstance(v, (dict, list))})
    elif d.get("part") == "timeline":
        ms = d["ms_per_step"]
        keys = ("step", "execute", "forward", "mask_wait", "verify", "append", "closing",
                "plain_fill", "fill_sum", "lookahead_sum", "other")
        print("TL c=%s s=%s n=%s tok/s=%s" % (d["constrained"], d["speculative"], d["requests"],
              d["tok_per_s"]), {k: ms.get(k) for k in keys})
    elif d.get("part") == "spec_equal_work" and "tok_per_s" in d:
        print("RUN b=%s c=%s s=%s tok/s=%.1f reps=%s" % (d["batch"], d["constrained"],
              d["speculative"], d["tok_per_s"], d.get("tok_per_s_reps")))
PY
done
