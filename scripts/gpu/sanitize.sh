#!/usr/bin/env bash
# Runs on the GPU machine (issue 66, item 2; docs/development.md, "The kernels under compute-sanitizer"): every
# hand-written kernel under compute-sanitizer's four tools (memcheck, racecheck, synccheck, initcheck), through the
# library's GPU tests (their shapes include one head, a window of 1, a block one past a tile) and a short real-model
# serve-train with a decoded evaluation. compute-sanitizer is the image's (/usr/local/cuda/bin, 2025.3.1 on
# 2026-12-07), else PyPI's nvidia-cuda-sanitizer-api wheel's where an image lacks it: `pip download --no-deps
# "nvidia-cuda-sanitizer-api==13.0.85" -d .whl/sanitizer`, carried in .whl/sanitizer/; the tests are `make gpu-bin`'s
# test-lib.
#   tests [TOOL..]   the library's GPU tests (every #[ignore]d test one GPU runs) under each TOOL (default: all four,
#                    and memcheck-nocache, below)
#   train [TOOL..]   serve-train on the real model under each TOOL (default: memcheck and memcheck-nocache, side by
#                    side): README's recipe for 6 steps of 8 rows, then a decoded evaluation of 4 held-out prompts (32
#                    new tokens, CUDA graphs; without them under memcheck-nocache); needs
#                    recipe.sh `part` and `data` (or `model` and synthesize.sh `synth`) earlier in the lease
# The tools of one stage run side by side (independent processes on one GPU: the condition the faults came from),
# each stopped after SANITIZE_LIMIT_S seconds (default 3000) so a short lease still brings back what finished.
# Each run's summary line to $out/sanitize.txt, its report to $out/TOOL-WHAT.log (the first 400 lines; the whole
# report stays in /tmp/dflash-recipe) and its distinct errors, each once with its count, to $out/TOOL-WHAT.distinct;
# these are packed into $out/sanitize-reports.tgz at the end (a call brings back at most 8 files).
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-recipe
unpack_binaries "$work/bin"
# The image's compute-sanitizer where it has one, else the wheel's.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
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
# The tests that capture CUDA graphs: capture takes its memory from the caching allocator, which memcheck-nocache
# turns off (cudaMalloc inside a capture fails), so that tool skips them.
graphed=(--skip replayed_ --skip a_replay_recomputes --skip in_bf16_decoding_is_lossless)
# racecheck instruments only the kernels of ours (the hazards it finds are in shared memory, which libtorch's kernels
# own for themselves): every kernel of libtorch's under it is what made the whole run take hours.
ours=(--kernel-name kns=staircase_ --kernel-name kns=decode_ --kernel-name kns=softmax --kernel-name kns=norm_rope
  --kernel-name kns=silu_mul)
# racecheck cannot run some of cuBLAS's and cuDNN's Hopper kernels even uninstrumented: the tool "failed to handle a
# hardware exception", then CUBLAS_STATUS_EXECUTION_FAILED or CUDNN_STATUS_INTERNAL_ERROR, and every later test of the
# process fails on the sticky error. Plain PyTorch's F.linear of [2, 122, 64] by [64, 64] in bf16 does the same
# (scripts/probes/racecheck_cublas.py). The target capture's test (that GEMM) and the real model's decoding test
# (cuDNN's attention) are the two that meet them; racecheck skips those two, whose kernels of ours the other tests run.
unrunnable=(--skip packed_rows_capture_what_each_captures_alone --skip in_bf16_decoding_is_lossless)
# The real model's test (bf16 decoding) reads it where recipe.sh `model` or `data` converted it earlier in the lease,
# and is skipped, saying so, where it was not.
if [ -f "$work/model/config.json" ]; then
  export DFLASH_REAL_MODEL=$work/model
else
  skip+=(--skip in_bf16_decoding_is_lossless)
  echo "no real model in $work/model (recipe.sh part and model first): its bf16 decoding test is skipped" \
    >>"$out/sanitize.txt"
fi
# The tests read their committed fixtures where they were built (CARGO_MANIFEST_DIR, this machine's checkout when
# `make gpu-bin` ran: DFLASH_BUILT_AT, default /work/main); that path is made to point at this copy where it is free.
built_at=${DFLASH_BUILT_AT:-/work/main}
[ -e "$built_at" ] || { mkdir -p "$(dirname "$built_at")" && ln -s "$PWD" "$built_at"; }

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
  local filter=()
  [ "$tool" = racecheck ] && filter=("${ours[@]}")
  timeout -s INT -k 30 "${SANITIZE_LIMIT_S:-3000}" "${env[@]}" "$sanitizer" --tool "$tool" --error-exitcode 99 \
    --print-limit 50 "${filter[@]}" "$@" >"$full" 2>&1
  code=$?
  [ $code -eq 124 ] && code="124 (stopped after ${SANITIZE_LIMIT_S:-3000} s)"
  head -n 400 "$full" >"$out/$name-$what.log"
  python3 scripts/gpu/distinct_errors.py "$full" >"$out/$name-$what.distinct"
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
      also=()
      [ "$tool" = memcheck-nocache ] && also=("${graphed[@]}")
      [ "$tool" = racecheck ] && also=("${unrunnable[@]}")
      sanitize "$tool" tests "$work/bin/test-lib" --test-threads 1 --include-ignored "${gpu_tests[@]}" "${skip[@]}" \
        "${also[@]}"
      grep -E "^test .* (ok|FAILED)$|test result" "$work/$tool-tests.full" | sed "s/^/$tool: /" | tail -20 \
        >>"$out/sanitize.txt"
    ) &
  done
  wait
  ;;
train)
  shift
  data=$(ls -d "$work"/data-synth-* "$work/data" 2>/dev/null | head -1)
  [ -n "$data" ] && [ -d "$work/model" ] ||
    { echo "run recipe.sh data (or model and synthesize.sh synth) first" >&2; exit 2; }
  head -n 4 "$work/heldout.jsonl" >"$work/sanitize-prompts.jsonl"
  tools=("$@")
  [ ${#tools[@]} -gt 0 ] || tools=(memcheck memcheck-nocache)
  for tool in "${tools[@]}"; do (
    r=$work/runs/sanitize-$tool
    rm -rf "$r" && mkdir -p "$r"
    graphs=true
    [ "$tool" = memcheck-nocache ] && graphs=false
    sanitize "$tool" train "$work/bin/dflash" serve-train --config config/smollm2-135m.toml \
      --set "target.model=$work/model" --set "data.path=$data" --set "data.ledger=$r/ledger.jsonl" \
      --set "checkpoint.dir=$r" --set control.listen=off --set optim.max_steps=6 --set data.batch_size=8 \
      --set checkpoint.every_steps=0 --set eval.every_steps=6 --set eval.num_prompts=4 \
      --set eval.max_new_tokens=32 --set "eval.prompts=$work/sanitize-prompts.jsonl" --set "eval.cuda_graphs=$graphs"
    grep -E "evaluation|run summary|ERROR|CUDA error" "$work/$tool-train.full" | cut -c1-300 >>"$out/sanitize.txt"
  ) & done
  wait
  ;;
*) echo "usage: $0 tests [TOOL..] | train [TOOL..]" >&2; exit 2 ;;
esac
(cd "$out" && tar czf sanitize-reports.tgz ./*.log ./*.distinct && rm -f ./*.log ./*.distinct)
