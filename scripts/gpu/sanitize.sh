#!/usr/bin/env bash
# Runs on the GPU machine (issue 66, item 2; docs/development.md, "The kernels under compute-sanitizer"): every
# hand-written kernel under compute-sanitizer's four tools (memcheck, racecheck, synccheck, initcheck), through the
# library's GPU tests (their shapes include one head, a window of 1, a block one past a tile) and a short real-model
# serve-train with a decoded evaluation. compute-sanitizer is the image's where it has one, else PyPI's
# nvidia-cuda-sanitizer-api wheel's: `pip download --no-deps "nvidia-cuda-sanitizer-api==13.0.85" -d .whl/sanitizer`
# (14 MB; carried in .whl/sanitizer/, which the GGUF's call does not carry); the tests are `make gpu-bin`'s test-lib.
#   tests [TOOL..]   the library's GPU tests (every #[ignore]d test one GPU runs) under each TOOL (default: all four,
#                    and memcheck-nocache, below)
#   train [TOOL..]   serve-train on the real model under each TOOL (default: memcheck and memcheck-nocache): README's recipe for 6 steps of
#                    8 rows, then a decoded evaluation of 4 held-out prompts (32 new tokens, CUDA graphs); needs
#                    recipe.sh `part` and `model` and synthesize.sh `synth` (any count) earlier in the lease
# The tools of one stage run side by side (independent processes on one GPU: the condition the faults came from),
# each stopped after SANITIZE_LIMIT_S seconds (default 3000) so a short lease still brings back what finished.
# Each run's summary line to $out/sanitize.txt, its report to $out/TOOL-WHAT.log (the first 400 lines; the whole
# report stays in /tmp/dflash-recipe).
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-recipe
unpack_binaries "$work/bin"
# The image's compute-sanitizer where it has one, else the wheel's.
sanitizer=$(command -v compute-sanitizer)
if [ -z "$sanitizer" ]; then
  site=/tmp/sanitizer
  [ -x "$site/nvidia/cu13/bin/compute-sanitizer" ] ||
    python3 -m pip install -q --no-index --no-deps --target "$site" .whl/sanitizer/*.whl || exit 2
  sanitizer=$site/nvidia/cu13/bin/compute-sanitizer
fi
"$sanitizer" --version | tail -1 | tee -a "$out/sanitize.txt"
gpu_name
# The tests that need one GPU (the NCCL ones need a second rank or a second GPU).
gpu_tests=(on_a_gpu_ replayed_ a_replay_recomputes)
skip=(--skip on_two_gpus --skip a_missing_rank)

# sanitize TOOL WHAT COMMAND..: COMMAND under TOOL, its verdict (the tool's error summary and the command's exit) in
# sanitize.txt.
# TOOL `memcheck-nocache` is memcheck with libtorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1): every
# free returns the memory to the driver, so a kernel that reads a tensor freed on another stream, or after its last
# use, reads unmapped memory and is reported, where the cache would have handed it a live block (issue 66, item 3).
sanitize() {
  local name=$1 tool=$1 what=$2 start=$SECONDS code full env=()
  shift 2
  full=$work/$name-$what.full
  [ "$tool" = memcheck-nocache ] && { env=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1); tool=memcheck; }
  timeout -s INT -k 30 "${SANITIZE_LIMIT_S:-3000}" "${env[@]}" "$sanitizer" --tool "$tool" --error-exitcode 99 \
    --print-limit 50 "$@" >"$full" 2>&1
  code=$?
  [ $code -eq 124 ] && code="124 (stopped after ${SANITIZE_LIMIT_S:-3000} s)"
  head -n 400 "$full" >"$out/$name-$what.log"
  echo "$name $what: exit $code in $((SECONDS - start)) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$full" |
    sort | uniq -c | tr -s ' ' | paste -sd ';')" | tee -a "$out/sanitize.txt"
}

case "${1:-}" in
tests)
  shift
  tools=("$@")
  [ ${#tools[@]} -gt 0 ] || tools=(memcheck memcheck-nocache racecheck synccheck initcheck)
  for tool in "${tools[@]}"; do
    (
      sanitize "$tool" tests "$work/bin/test-lib" --test-threads 1 --include-ignored "${gpu_tests[@]}" "${skip[@]}"
      grep -E "^test .* (ok|FAILED)$|test result" "$work/$tool-tests.full" | sed "s/^/$tool: /" | tail -20 \
        >>"$out/sanitize.txt"
    ) &
  done
  wait
  ;;
train)
  shift
  data=$(ls -d "$work"/data-synth-* 2>/dev/null | head -1)
  [ -n "$data" ] && [ -d "$work/model" ] || { echo "run recipe.sh model and synthesize.sh synth first" >&2; exit 2; }
  head -n 4 "$work/heldout.jsonl" >"$work/sanitize-prompts.jsonl"
  tools=("$@")
  [ ${#tools[@]} -gt 0 ] || tools=(memcheck memcheck-nocache)
  for tool in "${tools[@]}"; do
    r=$work/runs/sanitize-$tool
    rm -rf "$r" && mkdir -p "$r"
    sanitize "$tool" train "$work/bin/dflash" serve-train --config config/smollm2-135m.toml \
      --set "target.model=$work/model" --set "data.path=$data" --set "data.ledger=$r/ledger.jsonl" \
      --set "checkpoint.dir=$r" --set control.listen=off --set optim.max_steps=6 --set data.batch_size=8 \
      --set checkpoint.every_steps=0 --set eval.every_steps=6 --set eval.num_prompts=4 \
      --set eval.max_new_tokens=32 --set "eval.prompts=$work/sanitize-prompts.jsonl"
    grep -E "evaluation|run complete|ERROR|CUDA error" "$work/$tool-train.full" | cut -c1-300 >>"$out/sanitize.txt"
  done
  ;;
*) echo "usage: $0 tests [TOOL..] | train [TOOL..]" >&2; exit 2 ;;
esac
