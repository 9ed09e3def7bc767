#!/usr/bin/env bash
# Runs on the GPU machine (docs/operations.md, "Same seed, same result"; BENCHMARKS.md, "The default run"): what of
# `make run`'s recipe is deterministic on a GPU, in one call. Needs .gpu-bin/dflash.xz (`make gpu-bin`).
#   a, b  the recipe from nothing (the target answers the built-in conversations, bf16, batch 256), both at once
#   c     a's answers, trained again alone: training alone, same data
#   d     a's answers, with drafters.deterministic = true, twice
# Then the exported drafter of a decodes the 24 fresh questions of `make run`. Each run logs every step's exact
# numbers (dflash::steps); scripts/checks/compare_runs.py says where two runs first differ. Results go to $OUT.
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-determinism
unpack_binaries "$work/bin"
d=$work/bin/dflash
gpu_name
# One run of the recipe: name, then --set overrides.
run() {
  local name=$1
  shift
  local start=$SECONDS
  "$d" serve-train --config config/make-run.toml --set checkpoint.dir="$work/$name/ckpt" \
    --set data.cache_dir="$work/$name/data" --set control.listen=off --set log.format=json \
    --set log.level=info,dflash::steps=debug "$@" 2>"$work/$name.log" >/dev/null
  echo "run $name: rc $? in $((SECONDS - start)) s" | tee -a "$out/runs.txt"
}
run a &
run b &
wait
for r in c d1 d2; do
  mkdir -p "$work/$r" && cp -r "$work/a/data" "$work/$r/"
done
run c
run d1 --set drafters.deterministic=true
run d2 --set drafters.deterministic=true
for pair in "a b" "a c" "d1 d2" "a d1"; do
  set -- $pair
  python3 scripts/checks/compare_runs.py "$work/$1" "$work/$2" | tee -a "$out/compare.txt"
done
"$d" sample-data --count 24 --seed 777 --out "$work/fresh.jsonl"
"$d" eval --decode --target tiny-tasks --drafter "$work/a/ckpt/final" --prompts "$work/fresh.jsonl" \
  --max-new-tokens 96 2>&1 | tail -3 | tee "$out/fresh.txt"
for r in a c d1; do
  grep -E '"message":"(evaluation|decoded acceptance 1.00)' "$work/$r.log" >"$out/evals-$r.txt"
done
tail -c 200000 "$work/a.log" | xz >"$out/a-log-tail.xz"
