#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "Long contexts"): the drafter's step, the pipeline (target capture, then
# the step) and batch-1 decoding at 32K tokens on the qwen3-8b shapes, and at 128K on qwen3-8b-128k (YaRN) with
# sliding-window draft layers; then serve-train on 32K-token rows with a decoded evaluation of 32K-token prompts,
# its checkpoint, a resume from it, and `eval --decode` of the result. Expects `make gpu-bin`'s .gpu-bin/; results go
# to $OUT (or ./gpu-out).
# Usage: scripts/gpu/long.sh [test|bench|decode|serve|resume|all] (several: separated by commas)
set -uo pipefail
what=${1:-all}
source scripts/gpu/prologue.sh
bin=/tmp/dflash-bin
unpack_binaries "$bin"
gpu_name
bench() { echo "== $*" | tee -a "$out/bench.txt"; "$@" 2>>"$out/stderr.log" | tee -a "$out/results.jsonl"; }
sliding=(--set draft_model.layer_types=sliding_attention --set draft_model.sliding_window=2048)

if want test; then
  # The drafting graph replays a checkpoint loaded in place (the evaluator's kept graphs); the decoder's graphs.
  "$bin/test-lib" --test-threads 1 --include-ignored replayed_ 2>&1 | grep -E "^test |test result|panicked|assert" \
    | tee "$out/test.txt"
fi
if want bench; then
  bench "$bin/dflash" bench --what drafter --preset qwen3-8b --device cuda:0 --json --profile --batch 1 --seq 32768 \
    --anchors 2048 --steps 3
  bench "$bin/dflash" bench --what drafter --preset qwen3-8b --device cuda:0 --json --batch 1 --seq 32768 \
    --anchors 2048 --steps 3 "${sliding[@]}"
  bench "$bin/dflash" bench --what pipeline --preset qwen3-8b --device cuda:0 --json --profile --batch 1 \
    --seq 32768 --anchors 2048 --steps 3
  bench "$bin/dflash" bench --what drafter --preset qwen3-8b-128k --device cuda:0 --json --profile --batch 1 \
    --seq 131072 --anchors 2048 --steps 2 --warmup 1 "${sliding[@]}"
  bench "$bin/dflash" bench --what pipeline --preset qwen3-8b-128k --device cuda:0 --json --batch 1 --seq 131072 \
    --anchors 2048 --steps 2 --warmup 1 "${sliding[@]}"
fi
if want decode; then
  bench "$bin/dflash" bench --what decode --preset qwen3-8b --device cuda:0 --json --seq 32768 --steps 32
  bench "$bin/dflash" bench --what decode --preset qwen3-8b --device cuda:0 --json --seq 32768 --steps 32 \
    "${sliding[@]}"
fi
run=(--set target.model=qwen3-8b --set target.device=cuda:0 --set 'drafters.devices=["cuda:0"]'
  --set data.path=synthetic --set data.max_len=32768 --set data.batch_size=1 --set objective.num_anchors=2048
  --set checkpoint.dir=runs/long --set checkpoint.every_steps=3 --set checkpoint.keep=2 --set eval.every_steps=3
  --set eval.prompts=/tmp/long-prompts.jsonl --set eval.num_prompts=2 --set eval.max_new_tokens=32
  --set eval.cuda_graphs=true --set control.listen=off --set log.format=json --set log.every_steps=1
  --set supervision.check_replicas_every=0)
# Two prompts of 32,000 random tokens for the evaluations.
[ -f /tmp/long-prompts.jsonl ] || python3 -c '
import json, random
random.seed(0)
with open("/tmp/long-prompts.jsonl", "w") as f:
    for i in range(2):
        f.write(json.dumps({"id": i, "input_ids": [random.randrange(10, 150000) for _ in range(32000)]}) + "\n")
'
steps() {  # the progress, checkpoint, resume and evaluation lines of a serve-train log
  grep -E '"message":"(step [0-9]+ |resum|evaluation: decoded|checkpoint)' "$1" | python3 -c '
import json, sys
for line in sys.stdin:
    v = json.loads(line)
    print(v["timestamp"][11:19], v["fields"]["message"][:220])
' | tee -a "$out/bench.txt"
}
if want serve; then
  rm -rf runs/long
  echo "== serve-train, 32K rows, 6 steps" | tee -a "$out/bench.txt"
  "$bin/dflash" serve-train "${run[@]}" --set optim.max_steps=6 2>"$out/serve-long.log"
  echo "exit $?" | tee -a "$out/bench.txt"
  steps "$out/serve-long.log"
fi
if want resume; then
  echo "== serve-train resumed to step 9" | tee -a "$out/bench.txt"
  "$bin/dflash" serve-train --resume auto "${run[@]}" --set optim.max_steps=9 2>"$out/serve-long-resume.log"
  echo "exit $?" | tee -a "$out/bench.txt"
  steps "$out/serve-long-resume.log"
  ls runs/long | tee -a "$out/bench.txt"
  bench "$bin/dflash" eval --decode --target qwen3-8b --drafter runs/long --prompts /tmp/long-prompts.jsonl \
    --max-new-tokens 64 --device cuda:0 --json
fi
