#!/usr/bin/env bash
# Runs on the GPU machine (see BENCHMARKS.md): the GPU tests, then dflash's benchmarks beside the PyTorch peers in
# one lease. Expects stripped binaries in .bin/ (dflash and the test executables) and the peers in .peer/.
# Usage: scripts/gpu/bench.sh [target|drafter|spread|all]; results go to $OUT (or ./gpu-out).
set -uo pipefail
what=${1:-all}
source scripts/gpu/prologue.sh
gpu_name
# The GPU tests are #[ignore = "needs a GPU"] (or two GPUs, or the real model too) elsewhere: here they run with the rest.
gpu_tests=(--include-ignored)
[ "$(nvidia-smi -L | wc -l)" -lt 2 ] && gpu_tests+=(--skip on_two_gpus)
# The GPU test on the real model runs in scripts/gpu/real_model.sh, which brings the model.
[ -z "${DFLASH_REAL_MODEL:-}" ] && gpu_tests+=(--skip on_a_gpu_in_bf16_decoding)
for t in .bin/test-*; do
  [ -x "$t" ] && { echo "== $t"; "$t" --test-threads 1 "${gpu_tests[@]}" 2>&1 | grep -E "^test |test result" | grep -vE "\.\.\. ok$"; }
done
run() { echo "== $*"; "$@" 2>>"$out/stderr.log" | tee -a "$out/results.jsonl"; }
if [ "$what" = target ] || [ "$what" = all ]; then
  run ./.bin/dflash bench --what target --preset qwen3-8b --device cuda:0 --batch 16 --seq 2048 --steps 5 --json --profile
  run python3 .peer/pt_target_capture.py --batch 16 --seq 2048
fi
if [ "$what" = spread ]; then
  # A target spread over the GPUs (cuda:0 twice where there is one) by micro-batch count, against the unsplit one.
  n=$(nvidia-smi -L | wc -l)
  spread=$(python3 -c "print(','.join('cuda:%d' % i for i in range($n)) if $n > 1 else 'cuda:0,cuda:0')")
  run ./.bin/dflash bench --what target --preset qwen3-8b --device cuda:0 --batch 16 --seq 2048 --steps 8 --json
  for m in 1 2 4 8 16; do
    run ./.bin/dflash bench --what target --preset qwen3-8b --spread $spread --micro-batches $m --batch 16 --seq 2048 --steps 8 --json
  done
  for m in 1 4 8; do
    run ./.bin/dflash bench --what target --preset qwen3-30b-a3b --spread $spread --micro-batches $m --batch 16 --seq 2048 --steps 5 --json
  done
fi
if [ "$what" = drafter ] || [ "$what" = all ]; then
  run ./.bin/dflash bench --what drafter --preset qwen3-8b --device cuda:0 --batch 4 --seq 768 --anchors 256 --steps 8 --json --profile --capture
  run ./.bin/dflash bench --what drafter --preset qwen3-8b --device cuda:0 --batch 4 --seq 3072 --anchors 512 --steps 5 --json --profile
  run python3 .peer/pt_drafter_step.py --preset qwen3-8b --batch 4 --seq 768 --anchors 256 --variants eager,compile
  run python3 .peer/pt_drafter_step.py --preset qwen3-8b --batch 4 --seq 3072 --anchors 512 --steps 5 --variants eager
fi
