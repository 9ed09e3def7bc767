#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "The staircase attention kernels"): the kernels' GPU test against the
# grouped attention in f32, then the drafter's step at the Qwen3-8B drafter's shapes with the kernels and with the
# grouped attention they replace (DFLASH_STAIRCASE_ATTENTION=0), beside torch.compile's step (../shared/peer, carried
# in .peer/ when present). Expects `make gpu-bin`'s .gpu-bin/; results go to $OUT (or ./gpu-out).
# `wgmma` (issue 65, not in `all`): the training kernels on Hopper's warpgroup products (DFLASH_WGMMA=1): the layout
# probe (scripts/probes/wgmma_tile.cu, built by the image's nvcc), the kernels' GPU tests with it, each kernel alone
# by scripts/probes/staircase_kernel.py (both builds), and the drafter's step with it and without at 4x768/256,
# 4x3072/512 and 1x32768/2048.
# Usage: scripts/gpu/staircase.sh [test|probe|short|window|long|long-kernels|dflash2|peer|wgmma|all] (several:
# separated by commas)
set -uo pipefail
what=${1:-all}
source scripts/gpu/prologue.sh
bin=/tmp/dflash-bin
unpack_binaries "$bin"
gpu_name
if want test; then
  "$bin/test-lib" --test-threads 1 --include-ignored staircase 2>&1 | grep -E "^test |test result|panicked|assert" | tee "$out/test.txt"
fi
bench() {
  echo "== ${DFLASH_WGMMA:+DFLASH_WGMMA=1 }$*" | tee -a "$out/bench.txt"
  "$@" 2>>"$out/stderr.log" | tee -a "$out/results.jsonl"
}
# DRAFTER_LIMIT_S (default 0: none) bounds each step's run.
drafter() {
  timeout "${DRAFTER_LIMIT_S:-0}" "$bin/dflash" bench --what drafter --preset qwen3-8b --device cuda:0 --json --profile "$@"
}
if [[ ",$what," == *",wgmma,"* ]]; then
  nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_tile scripts/probes/wgmma_tile.cu &&
    /tmp/wgmma_tile | tee "$out/wgmma-probe.txt"
  # Bounded: a wrong wait or barrier in new kernels hangs rather than fails.
  DFLASH_WGMMA=1 timeout 180 "$bin/test-lib" --test-threads 1 --include-ignored staircase 2>&1 |
    grep -E "^test |test result|panicked|assert" | tee "$out/wgmma-test.txt"
  # Each kernel alone, exact against f32 attention and timed (TFLOP/s of the keys seen), mma.sync's and wgmma's.
  timeout 200 python3 scripts/probes/staircase_kernel.py 2>&1 | grep -v Warning | tee "$out/probe-mma.txt"
  WGMMA=1 timeout 200 python3 scripts/probes/staircase_kernel.py 2>&1 | grep -v Warning | tee "$out/probe-wgmma.txt"
  for shape in "4 768 256 6" "4 3072 512 6" "1 32768 2048 3"; do
    set -- $shape
    DRAFTER_LIMIT_S=120 bench drafter --batch $1 --seq $2 --anchors $3 --steps $4
    DRAFTER_LIMIT_S=120 DFLASH_WGMMA=1 bench drafter --batch $1 --seq $2 --anchors $3 --steps $4
  done
fi
if want probe; then
  python3 scripts/probes/staircase_kernel.py 2>&1 | grep -v Warning | grep -v run_backward | tee "$out/probe.txt"
fi
if want short; then
  for shape in "4 768 256" "4 3072 512"; do
    set -- $shape
    bench drafter --batch $1 --seq $2 --anchors $3 --steps 6
    DFLASH_STAIRCASE_ATTENTION=0 bench drafter --batch $1 --seq $2 --anchors $3 --steps 6
  done
fi
if want window; then
  # Sliding-window layers (causal blocks, as the recipe trains them) on the kernels, and on the grouped attention.
  sliding=(--set draft_model.layer_types=sliding_attention --set draft_model.sliding_window=2048)
  bench drafter --batch 4 --seq 3072 --anchors 512 --steps 6 "${sliding[@]}"
  DFLASH_STAIRCASE_ATTENTION=0 bench drafter --batch 4 --seq 3072 --anchors 512 --steps 6 "${sliding[@]}"
  bench drafter --batch 1 --seq 32768 --anchors 2048 --steps 3 "${sliding[@]}"
fi
if want long; then
  bench drafter --batch 1 --seq 8192 --anchors 512 --steps 4
  bench drafter --batch 1 --seq 32768 --anchors 2048 --steps 3
  DFLASH_STAIRCASE_ATTENTION=0 bench drafter --batch 1 --seq 32768 --anchors 2048 --steps 3
fi
if want long-kernels; then
  bench drafter --batch 1 --seq 32768 --anchors 2048 --steps 3
fi
if want dflash2; then
  # DFlash 2's blocks of 8 (two a warp) at the released drafters' shapes (every layer a non-causal sliding window of
  # 2048), with the kernels and with the grouped attention, and DFlash's at the same shapes on the kernels; then
  # 32K-token rows, which only the kernels can take.
  released=(--block-size 8 --set draft_model.variant=dflash2 --set draft_model.layer_types=sliding_attention
    --set draft_model.block_causal=false)
  for shape in "4 768 256" "4 3072 512"; do
    set -- $shape
    bench drafter --batch $1 --seq $2 --anchors $3 --steps 6 "${released[@]}"
    DFLASH_STAIRCASE_ATTENTION=0 bench drafter --batch $1 --seq $2 --anchors $3 --steps 6 "${released[@]}"
    bench drafter --batch $1 --seq $2 --anchors $3 --steps 6 "${released[@]}" --set draft_model.variant=dflash
  done
  bench drafter --batch 1 --seq 32768 --anchors 2048 --steps 3 "${released[@]}"
fi
if want peer && [ -f .peer/pt_drafter_step.py ]; then
  for shape in "4 768 256" "4 3072 512"; do
    set -- $shape
    bench python3 .peer/pt_drafter_step.py --preset qwen3-8b --batch $1 --seq $2 --anchors $3 --variants compile
  done
fi
