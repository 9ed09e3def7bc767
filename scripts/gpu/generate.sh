#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "Batched generation" and "A worked example: SmolLM2-135M"): batched
# generation beside HuggingFace's `generate`, then README's SmolLM2 walkthrough, in four calls made back to back while
# the machine stays up (everything lives in /tmp/dflash-real between them). A call carries at most 64 MiB: the GGUF
# crosses in two parts, the binaries xz-compressed in .gpu-bin/ (made by `make gpu-bin`): dflash with a, the tests
# with b (where they run first).
#   part  the first GGUF part alone (before b on a fresh machine)
#   a  the first GGUF part; qwen3-8b (random weights, fixed-length answers) with
#      `dflash bench --what generate` and scripts/peers/hf_generate.py; the built-in data's answering (tiny-tasks)
#   b  the second part; the GPU tests of batched generation; the real model converted; the first 1,024 of 2,160 instruction prompts answered by HF
#      `generate` (batch 512) and by `dflash regenerate --local` (batch 512, then 64), the answers compared; bench
#      generate on the real model with 32 prompts checked one at a time (bf16 near-ties)
#   c  README's walkthrough as written: regenerate, prepare, serve-train, eval --decode (bf16 and f32), export
#   d  the same training on a quarter and on half of the answers, each evaluated as in c
# Results go to $OUT (or ./gpu-out).
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-real
bin=$work/bin
mkdir -p "$work"
unpack_binaries "$bin"
d=$bin/dflash
# The GPU tests of batched generation, in the call that carries the test binary.
if [ -e .gpu-bin/test-lib.xz ]; then
  echo "== GPU tests" | tee -a "$out/commands.txt"
  "$bin/test-lib" --test-threads 1 --include-ignored batched sampling kv_cache ffi::graph decoder choice 2>&1 \
    | grep -E "^test |test result|panicked" | tee "$out/gpu-tests.txt"
fi
log() { echo "== $*" | tee -a "$out/commands.txt"; }
# Runs a command, then says how long it took and how it ended (on stderr and in commands.txt).
timed() {
  log "$@"
  local start rc
  start=$(date +%s.%N)
  "$@"
  rc=$?
  echo "wall $(python3 -c "import sys;print(round(float(sys.argv[2])-float(sys.argv[1]),1))" "$start" "$(date +%s.%N)") s, rc $rc" \
    | tee -a "$out/commands.txt" >&2
  return $rc
}
walk=$work/walk
# README's walkthrough runs in $walk with the model folder where README puts it.
walkthrough_setup() {
  mkdir -p "$walk/models" && ln -sfn "$work/model" "$walk/models/SmolLM2-135M-Instruct"
  cp -r config "$walk/" && cp scripts/fixtures/real_model.py "$walk/"
}
case "${1:-}" in
part)
  # The first GGUF part alone (for b on a machine where a has not run).
  cp .gpu/gguf.part-00 "$work/"
  ;;
a)
  cp .gpu/gguf.part-00 "$work/"
  gpu_name
  timed "$d" bench --what generate --preset qwen3-8b --device cuda:0 --batch 512 --prompts 512 --seq 64 --max-new 256 \
    --check 8 --json 2>>"$out/stderr.log" | tee -a "$out/generate.jsonl"
  timed python3 scripts/peers/hf_generate.py --preset qwen3-8b --batch 512 --prompts 512 --seq 64 --max-new 256 \
    2>>"$out/stderr.log" | tee -a "$out/generate.jsonl"
  "$d" sample-data --out "$work/builtin.jsonl" --count 512
  timed "$d" regenerate --local --model tiny-tasks --input "$work/builtin.jsonl" --out "$work/builtin-answers.jsonl" \
    --max-tokens 80 --device cuda:0 2>&1 | tail -2 | tee "$out/builtin.txt"
  ;;
b)
  cp .gpu/gguf.part-01 "$work/"
  real_model "$work" || exit 1
  python3 scripts/fixtures/real_model.py prompts "$work/bench.jsonl" bench
  head -n 1024 "$work/bench.jsonl" > "$work/bench-1024.jsonl"
  timed python3 scripts/fixtures/real_model.py answers "$work/model" "$work/bench-1024.jsonl" "$work/hf.jsonl" 512 2>&1 \
    | grep -v "^answered" | tee -a "$out/real-generate.txt"
  for b in 512 64; do
    rm -f "$work/dflash-$b.jsonl"
    timed "$d" regenerate --local --model "$work/model" --input "$work/bench-1024.jsonl" --out "$work/dflash-$b.jsonl" \
      --max-tokens 256 --batch $b 2>&1 | grep -E "conversations:|wall|==" | tee -a "$out/real-generate.txt"
  done
  python3 - "$work" <<'EOF' | tee -a "$out/real-generate.txt"
import json, sys
work = sys.argv[1]
def answers(name):
    with open(f"{work}/{name}.jsonl") as f:
        return {r["id"]: r["messages"][-1]["content"] for r in map(json.loads, f)}
a, b, h = answers("dflash-512"), answers("dflash-64"), answers("hf")
same = lambda x, y: sum(x[k] == y.get(k) for k in x)
print(json.dumps({"answers": len(a), "dflash_512_vs_64_identical": same(a, b), "dflash_512_vs_hf_identical": same(a, h)}))
EOF
  timed "$d" bench --what generate --model "$work/model" --device cuda:0 --batch 512 --prompts 1024 --seq 64 \
    --max-new 256 --check 32 --json 2>>"$out/stderr.log" | tee -a "$out/generate.jsonl"
  head -c 3000 "$work/dflash-512.jsonl" > "$out/answers-head.txt"
  ;;
c)
  walkthrough_setup
  cd "$walk" || exit 1
  # README, "A worked example: SmolLM2-135M-Instruct on one GPU", as written from step 2 on.
  python3 real_model.py prompts prompts.jsonl bench
  python3 real_model.py prompts heldout-all.jsonl heldout && awk 'NR % 3 == 1' heldout-all.jsonl > heldout.jsonl
  timed "$d" regenerate --local --model models/SmolLM2-135M-Instruct --input prompts.jsonl --out answers.jsonl \
    --max-tokens 256 2>&1 | grep -E "conversations:|wall|==" | tee "$out/walk-regenerate.txt"
  timed "$d" prepare --model models/SmolLM2-135M-Instruct --input answers.jsonl --out data/smollm2-135m \
    --max-len 512 --holdout 0.05 2>&1 | grep -E "conversations:|wrote|wall|==" | tee "$out/walk-prepare.txt"
  timed "$d" serve-train --config config/smollm2-135m.toml > "$out/walk-train.log" 2>&1
  echo "serve-train rc=$?" | tee -a "$out/commands.txt"
  grep -E "evaluation|run complete|step (100|400|800) " "$out/walk-train.log" | tail -8
  for dtype in bf16 f32; do
    timed "$d" eval --decode --target models/SmolLM2-135M-Instruct --drafter runs/smollm2-135m/best \
      --prompts heldout.jsonl --max-new-tokens 256 --dtype $dtype --json --dump "$out/walk-dump-$dtype.jsonl" \
      2>>"$out/stderr.log" | tee -a "$out/walk-eval.jsonl"
  done
  timed "$d" export --checkpoint runs/smollm2-135m/best --out drafters/smollm2-135m 2>&1 | tail -2 \
    | tee "$out/walk-export.txt"
  ls -la drafters/smollm2-135m | tee -a "$out/walk-export.txt"
  ;;
d)
  cd "$walk" || exit 1
  for n in 4 2; do
    awk -v n=$n 'NR % n == 1' answers.jsonl > "answers-1of$n.jsonl"
    "$d" prepare --model models/SmolLM2-135M-Instruct --input "answers-1of$n.jsonl" --out "data/1of$n" \
      --max-len 512 --holdout 0.05 2>&1 | tail -1 | tee -a "$out/scale.txt"
    timed "$d" serve-train --config config/smollm2-135m.toml --set "data.path=data/1of$n" \
      --set "checkpoint.dir=runs/1of$n" --set "data.ledger=runs/1of$n/ledger.jsonl" > "$out/scale-1of$n.log" 2>&1
    grep -E "evaluation:|run complete" "$out/scale-1of$n.log" | tail -3 | tee -a "$out/scale.txt"
    timed "$d" eval --decode --target models/SmolLM2-135M-Instruct --drafter "runs/1of$n/best" \
      --prompts heldout.jsonl --max-new-tokens 256 --dtype bf16 --json 2>>"$out/stderr.log" \
      | tee -a "$out/scale-eval.jsonl"
  done
  ;;
*) echo "usage: $0 part|a|b|c|d" >&2; exit 2 ;;
esac
