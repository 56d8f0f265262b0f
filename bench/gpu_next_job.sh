#!/usr/bin/env bash
# The next GPU job for the batch-32 ratio (issues 7/8; not run: no device time in session 19).
# Needs .whl/ (../shared/gpu/wheels.sh) and a converted tokenizer in .data/gpu/gemma_tok; run on the device
# machine from the repo root after the wheel install line, with $OUT set.
nproc; lscpu | grep -E "Model name|MHz|Socket|Thread|NUMA node\(s\)" ; cat /proc/loadavg
for w in 2 4; do timeout 60 python3 bench/closing_steady.py --streams bench/inputs/h200_b32_streams.jsonl --depth 8 --reps 2 --workers $w 2>&1 | tail -1 | tee -a $OUT/steady97.jsonl; done
A="--tokenizer .data/gpu/gemma_tok --skip-decode --spec-reps 2 --spec-batches 32 --profile-batch 0"
timeout 360 python3 bench/gpu_timeline.py $A --close-ahead default,default --torch-threads default,4 > $OUT/tl97.jsonl 2> $OUT/tl97.err; echo tl rc $?
tail -2 $OUT/tl97.err
python3 - <<'PY'
import json, os
for l in open(os.environ['OUT'] + '/tl97.jsonl'):
    d = json.loads(l)
    if 'constrained_over_unconstrained_speculative' in d: print('RATIO', {k: v for k, v in d.items() if not isinstance(v, (dict, list))})
    if d.get('part') != 'timeline' or not d.get('speculative') or not d['constrained']: continue
    print('C', d['tok_per_s'])
    for k in ('step', 'append', 'take', 'finish', 'workers_busy', 'workers_answer'): print('   ', k, d['per_step_ms'].get(k))
    for k, v in d.get('per_step_counts', {}).items(): print('   ', k, v)
PY
