#!/usr/bin/env bash
# Runs on the GPU machine (issue 65, item 1): speculators 0.9.0's own DFlash training step, the standing peer
# (../shared/peer/spec_dflash_step.py: its DFlashDraftModel under torch.compile as shipped, FlexAttention block
# masks, fp32 master weights under bf16 autocast; its loss eager, since the fused Triton loss fails under
# torch.compile on torch 2.11), beside `dflash bench --what drafter`, alternated, at the Qwen3-8B drafter's shapes,
# with AdamW and with Muon. Both sides as speculators' CLI sets them: 5 layers, every layer a sliding window of 2048
# causal inside the block, D-PACE cross-entropy on the target's argmax, each micro-batch's conversations packed into
# one row with the same anchors a conversation.
# Carry: .gpu-bin/dflash.xz (`make gpu-bin`), .whl/speculators (scripts/peers/speculators_wheels.sh; move its pyarrow
# and datasets wheels aside for this call, which a stub replaces below: speculators' training run needs them) and .peer
# (`cp -r ../shared/peer .peer`); about 14 MB.
#   [SHAPE..]   BATCHxSEQ/ANCHORS, anchors a conversation (default: 4x768/256 4x3072/512 1x32768/2048)
# One JSON line per measurement to $OUT/peer_step.jsonl, tagged with side, shape and optimizer; stderr to
# $OUT/peer_step.stderr. A side that fails (out of memory) writes its error and the next one runs.
set -uo pipefail
source scripts/gpu/prologue.sh
work=/tmp/dflash-peer
unpack_binaries "$work/bin"
speculators_wheels || exit 2
# speculators imports `datasets` at start (its data loaders), which the device lacks and which brings pyarrow (49 MB,
# past the carry's limit): the step never reads a dataset, so a stub with the names it imports stands in.
if ! python3 -c "import datasets" 2>/dev/null; then
  mkdir -p "$speculators_site/datasets"
  printf '%s\n' 'class Dataset: pass' 'def load_from_disk(*a, **k): raise RuntimeError("stub")' \
    'def load_dataset(*a, **k): raise RuntimeError("stub")' 'def concatenate_datasets(*a, **k): raise RuntimeError("stub")' \
    >"$speculators_site/datasets/__init__.py"
fi
gpu_name
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(4x768/256 4x3072/512 1x32768/2048)
tag() { python3 -c 'import json,sys; d=dict(zip(sys.argv[1::2], sys.argv[2::2])); print(json.dumps(d))' "$@"; }
for shape in "${shapes[@]}"; do
  batch=${shape%%x*} rest=${shape#*x}
  seq=${rest%/*} anchors=${rest#*/}
  for optimizer in adamw muon; do
    for side in dflash speculators; do
      tag side "$side" shape "$shape" optimizer "$optimizer" >>"$out/peer_step.jsonl"
      echo "== $side $shape $optimizer" >>"$out/peer_step.stderr"
      if [ "$side" = dflash ]; then
        "$work/bin/dflash" bench --what drafter --preset qwen3-8b --device cuda:0 --json --batch "$batch" \
          --seq "$seq" --anchors "$anchors" --pack "$batch" --steps 8 --warmup 3 \
          --set "optim.optimizer=$optimizer" --set objective.target=argmax \
          --set draft_model.layer_types=sliding_attention --set draft_model.sliding_window=2048 \
          --set draft_model.block_causal=true 2>>"$out/peer_step.stderr" | tail -1 >>"$out/peer_step.jsonl"
      else
        python3 .peer/spec_dflash_step.py --batch "$batch" --seq "$seq" --anchors "$anchors" \
          --steps 8 --warmup 3 --variants compile --loss-impl eager --optimizer "$optimizer" \
          2>>"$out/peer_step.stderr" | tail -1 >>"$out/peer_step.jsonl"
      fi
      tail -1 "$out/peer_step.jsonl"
    done
  done
done
