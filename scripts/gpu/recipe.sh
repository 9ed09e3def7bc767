#!/usr/bin/env bash
# Runs on the GPU machine (BENCHMARKS.md, "The recipe on the real model"): README's SmolLM2-135M-Instruct recipe
# (config/smollm2-135m.toml: 2,160 prompts answered by the model, 800 steps) trained once per recipe variant and
# seed, several runs at once on the one GPU, each drafter then decoded on the 64 unseen-topic prompts (bf16, 256 new
# tokens, graphs). Calls made back to back while the machine stays up; everything lives in /tmp/dflash-recipe.
# A call carries at most 64 MiB: the GGUF crosses in parts (.gpu/gguf.part-NN, scripts/gpu/carry.sh: 43,000,000 bytes
# beside .gpu-bin, the rest beside gguf's wheel), each call copying the parts it carries,
# the binary xz-compressed (.gpu-bin/dflash.xz, `make gpu-bin`), gguf's wheel in .whl/.
#   part                 the GGUF parts carried and the binary
#   data                 the parts carried; the model converted; prompts; answers (regenerate --local); prepare
#   model                `data` up to the prompts: the model and the 64 unseen-topic prompts alone
#   runs SEED VARIANT..  the variants (below) trained at once with objective.seed SEED, then decoded one by one
#   bench                the drafter's step at the qwen3-8b shapes by objective and attention (needs only `part`)
#   muon                 the step with AdamW and with Muon at the qwen3-8b shapes, this binary against
#                        .gpu-bin/dflash-base.xz (only `part`)
#   small                README's recipe at the real model's shapes (the smollm2-135m preset, random: no model files;
#                        128 rows of 512 tokens, 32 anchors): the pipeline's step profiled for the plain objective
#                        (D-PACE, AdamW, the data's tokens), with Muon (and Gram), with KL, and the recipe (Muon and
#                        KL), two rounds (the plain one and the recipe also by .gpu-bin/dflash-base.xz where it is
#                        carried), then both with the LM head's chunks of 8,192 rows: where the recipe's samples/s go
#                        (issue 65, item 4; only `part`)
#   pack [SEQ/ANCHORS..] the drafter's step and the pipeline at the qwen3-8b shapes (4 conversations of SEQ tokens,
#                        default 768/256), packed and not (only `part`)
#   dflash2              DFlash 2's drafter step and batch-1 drafting pass beside DFlash's at the released drafters'
#                        shapes (only `part`)
#   test [FILTER..]      the library's GPU tests FILTER names (default: packed rows and graphed drafting;
#                        .gpu-bin/test-lib.xz)
#   lengths chat|data..  serve-train at the qwen3-8b shapes on chat lengths, or (after `data`) this data's lengths:
#                        length-bucketed batches against packed rows (scripts/gpu/service.sh's stage 12)
# Results go to $OUT (or ./gpu-out).
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-recipe
unpack_binaries "$work/bin"
d=$work/bin/dflash
# The --set overrides of each variant, each naming its slot weights and optimizer (config/smollm2-135m.toml itself
# is D-PACE and Muon, the measured best).
variant() {
  local paper="--set objective.weights=decay" dpace="--set objective.weights=dpace"
  local adamw="--set optim.optimizer=adamw" muon="--set optim.optimizer=muon"
  case "$1" in
  paper) echo "$paper $adamw" ;;
  dpace) echo "$dpace $adamw" ;;
  muon) echo "$paper $muon" ;;
  muon3) echo "$paper $muon --set optim.muon_lr=3e-3" ;;
  dpace-muon) echo "$dpace $muon" ;;
  dpace-muon3) echo "$dpace $muon --set optim.muon_lr=3e-3" ;;
  dpace-muon-gram) echo "$(variant dpace-muon) --set optim.muon_iteration=gram" ;;
  argmax) echo "$dpace $muon --set objective.target=argmax" ;;
  kl) echo "$dpace $muon --set objective.target=argmax --set objective.loss=kl" ;;
  kl-adamw) echo "$dpace $adamw --set objective.target=argmax --set objective.loss=kl" ;;
  kl-gram) echo "$(variant kl) --set optim.muon_iteration=gram" ;;
  swa) echo "$dpace $muon --set draft_model.layer_types=sliding_attention" ;;
  swa128) echo "$dpace $muon --set draft_model.layer_types=sliding_attention --set draft_model.sliding_window=128" ;;
  all) echo "$dpace $muon --set objective.target=argmax --set objective.loss=kl --set draft_model.layer_types=sliding_attention" ;;
  all128) echo "$(variant all) --set draft_model.sliding_window=128" ;;
  # Packed rows of 1024 tokens, 4 a batch: about the tokens of 16 conversations of this data (258 on average).
  kl-pack) echo "$(variant kl) --set data.pack=true --set data.pack_len=1024 --set data.batch_size=4" ;;
  # DFlash 2 on the best DFlash recipe (README's run.toml), its sizes the released drafters'.
  kl-dflash2) echo "$(variant kl) --set draft_model.variant=dflash2" ;;
  *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
case "${1:-}" in
part)
  cp .gpu/gguf.part-* "$work/" && ls -la "$work" "$work/bin"
  ;;
model | data)
  gpu_name
  cp .gpu/gguf.part-* "$work/" 2>/dev/null
  real_model "$work" || exit 1
  python3 scripts/fixtures/real_model.py prompts "$work/prompts.jsonl" bench
  python3 scripts/fixtures/real_model.py prompts "$work/heldout-all.jsonl" heldout
  awk 'NR % 3 == 1' "$work/heldout-all.jsonl" >"$work/heldout.jsonl"
  [ "$1" = model ] && exit 0
  "$d" regenerate --local --model "$work/model" --input "$work/prompts.jsonl" --out "$work/answers.jsonl" \
    --max-tokens 256 2>&1 | grep -E "conversations:" | tee "$out/regenerate.txt"
  "$d" prepare --model "$work/model" --input "$work/answers.jsonl" --out "$work/data" --max-len 512 \
    --holdout 0.05 2>&1 | tail -4 | tee "$out/prepare.txt"
  sha256sum "$work/answers.jsonl" | tee -a "$out/prepare.txt"
  ;;
runs)
  seed=$2
  shift 2
  start=$SECONDS
  pids=()
  for v in "$@"; do
    r=$work/runs/$v-s$seed
    rm -rf "$r" && mkdir -p "$r"
    # shellcheck disable=SC2046
    "$d" serve-train --config config/smollm2-135m.toml --set "target.model=$work/model" --set "data.path=$work/data" \
      --set "data.ledger=$r/ledger.jsonl" --set "checkpoint.dir=$r" --set control.listen=off \
      --set "objective.seed=$seed" $(variant "$v") >"$r/train.log" 2>&1 &
    pids+=("$!")
  done
  codes=()
  for p in "${pids[@]}"; do
    code=0
    wait "$p" || code=$?
    codes+=("$code")
  done
  echo "seed $seed: ${*} trained at once in $((SECONDS - start)) s; exit codes ${codes[*]}" | tee -a "$out/runs.txt"
  for v in "$@"; do
    r=$work/runs/$v-s$seed
    echo "== $v seed $seed" >>"$out/runs.txt"
    grep -E "evaluation|run complete|step (100|400|800) |ERROR|CUDA error" "$r/train.log" | cut -c1-300 >>"$out/runs.txt"
    "$d" eval --decode --target "$work/model" --drafter "$r/final" --prompts "$work/heldout.jsonl" \
      --max-new-tokens 256 --json 2>>"$out/eval.stderr" | sed "s/^/{\"variant\":\"$v\",\"seed\":$seed,\"eval\":/; s/\$/}/" \
      | tee -a "$out/eval.jsonl"
  done
  ;;
bench)
  # The drafter's step at the qwen3-8b shapes (random weights) by objective and attention, then the pipeline (the
  # target's capture included) with the data's tokens and with the target's argmax.
  gpu_name
  b() { echo "== $*" >>"$out/bench.stderr"; "$d" bench --what "$@" --preset qwen3-8b --device cuda:0 --json \
    2>>"$out/bench.stderr" | tee -a "$out/bench.jsonl"; }
  for shape in "--batch 4 --seq 768 --anchors 256" "--batch 4 --seq 3072 --anchors 512"; do
    for objective in "" "--set objective.target=argmax" "--set objective.target=argmax --set objective.loss=kl" \
      "--set draft_model.layer_types=sliding_attention" \
      "--set draft_model.layer_types=sliding_attention --set draft_model.sliding_window=512"; do
      echo "{\"shape\": \"$shape\", \"set\": \"$objective\"}" >>"$out/bench.jsonl"
      # shellcheck disable=SC2086
      b drafter $shape --steps 6 --profile $objective
    done
  done
  for objective in "" "--set objective.target=argmax"; do
    echo "{\"shape\": \"pipeline 4x768/256\", \"set\": \"$objective\"}" >>"$out/bench.jsonl"
    # shellcheck disable=SC2086
    b pipeline --batch 4 --seq 768 --anchors 256 --steps 6 $objective
  done
  ;;
muon)
  # Muon's cost (issue 65, item 2): the drafter's step at the qwen3-8b shapes with AdamW and with Muon, its
  # `optimizer` phase profiled, by this binary and by a baseline carried as .gpu-bin/dflash-base.xz (the binary before
  # the change: same lease, same card), alternated, two rounds.
  gpu_name
  for round in 1 2; do
    for bin in dflash dflash-base; do
      [ -x "$work/bin/$bin" ] || continue
      for shape in "--batch 4 --seq 768 --anchors 256" "--batch 4 --seq 3072 --anchors 512"; do
        for opt in adamw muon; do
          echo "{\"round\": $round, \"binary\": \"$bin\", \"shape\": \"$shape\", \"optimizer\": \"$opt\"}" \
            >>"$out/muon.jsonl"
          # shellcheck disable=SC2086
          "$work/bin/$bin" bench --what drafter --preset qwen3-8b --device cuda:0 --json $shape --steps 8 --profile \
            --set optim.optimizer=$opt 2>>"$out/bench.stderr" | tee -a "$out/muon.jsonl"
        done
      done
    done
  done
  ;;
small)
  gpu_name
  # One profiled pipeline step at the real model's shapes by BINARY (in $work/bin), labelled ROUND and VARIANT, with
  # the variant's --sets and ARGS.
  profile_small() {
    echo "{\"round\": \"$2\", \"binary\": \"$1\", \"variant\": \"$3\"}" >>"$out/small.jsonl"
    # shellcheck disable=SC2046
    "$work/bin/$1" bench --what pipeline --preset smollm2-135m --device cuda:0 --batch 128 --seq 512 --anchors 32 \
      --steps 8 --json --profile "${@:4}" $(variant "$3") 2>>"$out/bench.stderr" | tee -a "$out/small.jsonl"
  }
  for round in 1 2; do
    # The plain objective (dpace: D-PACE, AdamW), with Muon, with Gram's Muon, with KL, the recipe (kl), and with Gram.
    for v in dpace dpace-muon dpace-muon-gram kl-adamw kl kl-gram; do profile_small dflash "$round" "$v"; done
    # A baseline binary carried as .gpu-bin/dflash-base.xz (before a change): the plain objective and the recipe.
    if [ -x "$work/bin/dflash-base" ]; then
      for v in dpace kl; do profile_small dflash-base "$round" "$v"; done
    fi
  done
  # The LM head's chunks four times as long (fewer launches and syncs a step, 4 x the logits' memory).
  for v in dpace kl; do profile_small dflash chunk-8192 "$v" --lm-head-chunk-rows 8192; done
  ;;
pack)
  # Packing at the qwen3-8b shapes: 4 conversations of 768 tokens as 4 rows, and packed into one row of 3072; the
  # drafter's step alone and the pipeline (the target's capture of packed rows included).
  gpu_name
  b() { echo "== $*" >>"$out/bench.stderr"; "$d" bench --what "$@" --preset qwen3-8b --device cuda:0 --json \
    2>>"$out/bench.stderr" | tee -a "$out/bench.jsonl"; }
  shift
  for shape in "${@:-768/256}"; do
    for what in drafter pipeline; do
      for pack in 1 4; do
        b "$what" --batch 4 --seq "${shape%/*}" --anchors "${shape#*/}" --steps 6 --profile --pack "$pack"
      done
    done
  done
  ;;
dflash2)
  # DFlash 2's step beside DFlash's at the released drafters' shapes (qwen3-8b, 5 layers, block 8, every layer a
  # non-causal sliding window of 2048), random weights.
  gpu_name
  swa="--set draft_model.layer_types=sliding_attention --set draft_model.block_causal=false"
  for shape in "--batch 4 --seq 768 --anchors 256" "--batch 4 --seq 3072 --anchors 512"; do
    for v in dflash dflash2; do
      echo "{\"shape\": \"$shape\", \"variant\": \"$v\"}" >>"$out/bench.jsonl"
      # shellcheck disable=SC2086
      "$d" bench --what drafter --preset qwen3-8b --device cuda:0 --json --block-size 8 $shape --steps 6 --profile \
        $swa --set draft_model.variant=$v 2>>"$out/bench.stderr" | tee -a "$out/bench.jsonl"
    done
  done
  # Batch-1 decoding at the same shapes: the drafting pass of each (DFlash 2's convolutions and selector walk)
  # beside the 8B target's verification, eager and from CUDA graphs.
  for v in dflash dflash2; do
    echo "{\"decode\": \"qwen3-8b, block 8, context 1024\", \"variant\": \"$v\"}" >>"$out/bench.jsonl"
    # shellcheck disable=SC2086
    "$d" bench --what decode --preset qwen3-8b --device cuda:0 --json --block-size 8 --seq 1024 --steps 64 \
      $swa --set draft_model.variant=$v 2>>"$out/bench.stderr" | tee -a "$out/bench.jsonl"
  done
  ;;
test)
  # The library's GPU tests named by FILTERs (test-lib, in .gpu-bin beside the binary); by default those of packed
  # rows and of drafting from CUDA graphs (DFlash and DFlash 2).
  shift
  filters=("$@")
  [ ${#filters[@]} -gt 0 ] || filters=(packed_rows replayed_drafting)
  "$work/bin/test-lib" --test-threads 1 --include-ignored "${filters[@]}" >"$out/gpu-tests.txt" 2>&1
  grep -E "^test |test result|panicked" "$out/gpu-tests.txt"
  ;;
lengths)
  # One packed row of up to 4096 tokens a step holds about as many conversations as a bucketed batch: 4 of chat
  # lengths (about 1,000 tokens on average), 16 of this data's (258).
  mkdir -p .bin && cp "$d" .bin/dflash
  shift
  for what in "$@"; do
    case "$what" in
    chat) STAGES=12 RECIPE_DATA=synthetic-chat RECIPE_PACK="off 4096" OUT=$out scripts/gpu/service.sh ;;
    data) STAGES=12 RECIPE_DATA=$work/data RECIPE_BATCH=16 RECIPE_PACK="off 4096" OUT=$out scripts/gpu/service.sh ;;
    *) echo "lengths: chat or data, not $what" >&2; exit 2 ;;
    esac
  done
  ;;
*) echo "usage: $0 part | data | runs SEED VARIANT... | bench | muon | pack [SEQ/ANCHORS...] | dflash2 | test [FILTER..] | lengths chat|data..." >&2; exit 2 ;;
esac
