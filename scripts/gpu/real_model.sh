#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "A real model"): SmolLM2-135M-Instruct, the tests' real model, in bf16 with
# CUDA graphs. The model arrives as its GGUF in two parts (a call carries at most 64 MiB), one stage each, in calls
# made back to back while the machine stays up; everything lives in /tmp/dflash-real between them.
#   scripts/gpu/real_model.sh part    copies .gpu/gguf.part-* to /tmp/dflash-real (scripts/gpu/carry.sh's parts of the GGUF
#                                     setup.sh extracts into the cache's wheels/ folder)
#   scripts/gpu/real_model.sh convert joins the parts (SHA-256 checked), converts them with transformers' GGUF reader
#                                     (the wheel of gguf in .whl), writes the train and held-out prompts and the
#                                     model's own greedy answers to the train prompts (HF generate, bf16, batched)
#   scripts/gpu/real_model.sh train   prepare; serve-train a 4-layer drafter with in-training evaluation on the held-out
#                                     prompts (bf16, 256 new tokens); eval --decode of the 64 held-out prompts; the GPU
#                                     tests (.bin/test-*), the planted-bug test on the real model with that drafter
# Results go to $OUT (or ./gpu-out).
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-real
mkdir -p "$work"
case "${1:-}" in
part)
  cp .gpu/gguf.part-* "$work/" && ls -la "$work"
  ;;
convert)
  cp .gpu/gguf.part-* "$work/"
  real_model "$work" || exit 1
  python3 scripts/fixtures/real_model.py prompts "$work/train-prompts.jsonl" train
  python3 scripts/fixtures/real_model.py prompts "$work/heldout-all.jsonl" heldout
  # Every third: 64 prompts over all 16 held-out topics.
  awk 'NR % 3 == 1' "$work/heldout-all.jsonl" >"$work/heldout.jsonl"
  time python3 scripts/fixtures/real_model.py answers "$work/model" "$work/train-prompts.jsonl" "$work/answers.jsonl" 2>&1 | tail -2
  wc -l "$work"/*.jsonl | tee "$out/data.txt"
  head -c 2000 "$work/answers.jsonl" >"$out/answers-head.txt"
  ;;
train)
  gpu_name
  d=./.bin/dflash
  rm -rf "$work/prepared" "$work/ckpt"
  $d prepare --model "$work/model" --input "$work/answers.jsonl" --out "$work/prepared" --max-len 512 \
    --block-size 16 --holdout 0.05 2>&1 | tail -3 | tee "$out/prepare.txt"
  $d serve-train --config scripts/gpu/real_model.toml --set "target.model=$work/model" \
    --set "data.path=$work/prepared" --set "checkpoint.dir=$work/ckpt" --set "eval.prompts=$work/heldout.jsonl" \
    >"$out/train.log" 2>&1
  echo "serve-train rc=$?"
  grep -E "evaluation:|decoded acceptance 1.00|run complete" "$out/train.log"
  grep -E "step (100|300|600|900) " "$out/train.log"
  $d eval --decode --target "$work/model" --drafter "$work/ckpt/final" --prompts "$work/heldout.jsonl" \
    --max-new-tokens 256 --json --dump "$out/dump.jsonl" 2>>"$out/eval.stderr" | tee -a "$out/eval.jsonl"
  export DFLASH_REAL_MODEL=$work/model DFLASH_REAL_DRAFTER=$work/ckpt/final
  for t in .bin/test-*; do
    echo "== $t"
    "$t" --test-threads 1 --include-ignored --nocapture choice objective decode_eval ffi::graph decoder speculative 2>&1 \
      | grep -E "^test |test result|Some\(|None \(|panicked" | tee -a "$out/gpu-tests.txt"
  done
  ;;
*) echo "usage: $0 part|convert|train" >&2; exit 2 ;;
esac
