#!/usr/bin/env bash
# `make check-exports`: dflash's drafter exports against the reference Python packages, on the CPU.
#   - speculators 0.9.0: dflash's --format speculators equals what its own DFlashConverter makes of dflash's
#     --format zlab (config.json and every tensor), and loads with its DFlashDraftModel;
#   - z-lab's model definition (PyPI `dflash` 0.1.0, z-lab's own package): the zlab export loads, and its forward
#     on the tiny target's tapped states equals dflash's (tests/exports.rs, run here on the fresh output), for the
#     paper's layers and for a drafter with a sliding-window layer (z-lab's model applies the window and causality
#     its config.json says, as vLLM and SGLang do);
#   - speculators' DFlash 2 (DFlash2DraftModel): a DFlash 2 drafter's speculators export loads, and one training step
#     of dflash's equals speculators' in loss and every gradient; the folder its save_pretrained writes starts a run
#     (tests/dflash2.rs, on the fresh output; --write-fixture refreshes tests/fixtures/dflash2-speculators).
# Needs network once: the packages go into a per-user venv (~5 GB with the torch they pin). Pass --write-fixture to
# refresh tests/fixtures/zlab-forward and zlab-forward-sliding (what CI compares against without Python).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache="${DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
venv="$cache/check-exports-speculators-0.9.0"
say() { printf '[check-exports] %s\n' "$*" >&2; }

if [ ! -f "$venv/.complete" ]; then
  say "installing speculators==0.9.0 and z-lab's dflash==0.1.0 into $venv (once)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check speculators==0.9.0 dflash==0.1.0
  # transformers imports torchaudio when present, and the one pip brings does not load beside this torch.
  "$venv/bin/python" -m pip uninstall --quiet -y torchaudio || true
  touch "$venv/.complete"
fi

cargo build --quiet
bin="$root/target/debug/dflash"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say "a tiny drafter: 2 steps of serve-train on the tiny-tasks target (synthetic rows, CPU)"
"$bin" export --preset tiny-tasks --out "$work/target" >/dev/null
"$bin" serve-train --set target.model=tiny-tasks --set target.device=cpu --set 'drafters.devices=["cpu"]' \
  --set data.path=synthetic --set data.builtin_conversations=8 --set data.max_len=64 --set data.batch_size=2 \
  --set draft_model.num_hidden_layers=1 --set optim.max_steps=2 --set checkpoint.dir="$work/ckpt" \
  --set control.listen=off --set log.level=warn
"$bin" export --checkpoint "$work/ckpt" --format zlab --out "$work/zlab" >/dev/null
"$bin" export --checkpoint "$work/ckpt" --format speculators --verifier "$work/target" --out "$work/speculators" >/dev/null
say "a drafter whose first layer slides (a window of 8, causal) and whose second attends fully, trained as well"
"$bin" serve-train --set target.model=tiny-tasks --set target.device=cpu --set 'drafters.devices=["cpu"]' \
  --set data.path=synthetic --set data.builtin_conversations=8 --set data.max_len=64 --set data.batch_size=2 \
  --set draft_model.num_hidden_layers=2 --set 'draft_model.layer_types=["sliding_attention", "full_attention"]' \
  --set draft_model.sliding_window=8 --set optim.max_steps=2 --set checkpoint.dir="$work/ckpt-sliding" \
  --set control.listen=off --set log.level=warn
"$bin" export --checkpoint "$work/ckpt-sliding" --format zlab --out "$work/zlab-sliding" >/dev/null
say "a DFlash 2 drafter (block 8, rank 16, 4 candidates), trained as well, exported in f32 in both layouts"
"$bin" serve-train --set target.model=tiny-tasks --set target.device=cpu --set 'drafters.devices=["cpu"]' \
  --set data.path=synthetic --set data.builtin_conversations=8 --set data.max_len=64 --set data.batch_size=2 \
  --set draft_model.num_hidden_layers=2 --set draft_model.variant=dflash2 --set draft_model.block_size=8 \
  --set draft_model.selector_rank=16 --set draft_model.selector_top_k=4 --set optim.max_steps=4 \
  --set checkpoint.dir="$work/ckpt-dflash2" --set control.listen=off --set log.level=warn
mkdir -p "$work/dflash2"
cp -r "$work/target" "$work/dflash2/target"
"$bin" export --checkpoint "$work/ckpt-dflash2" --format zlab --dtype f32 --out "$work/dflash2/zlab" >/dev/null
"$bin" export --checkpoint "$work/ckpt-dflash2" --format speculators --dtype f32 --verifier "$work/dflash2/target" \
  --out "$work/dflash2/speculators" >/dev/null
fixture=()
dflash2_out="$work/dflash2-speculators"
if [ "${1:-}" = "--write-fixture" ]; then
  fixture=(--write-fixture "$root/tests/fixtures")
  dflash2_out="$root/tests/fixtures/dflash2-speculators"
fi
say "speculators' DFlash2DraftModel: loads the speculators export, one training step, and save_pretrained"
"$venv/bin/python" "$root/scripts/fixtures/make_dflash2_fixtures.py" --model "$work/dflash2" --out "$dflash2_out" \
  2> >(grep -v -e '| INFO' -e '| DEBUG' -e '| WARNING' -e 'Loading weights' -e 'Writing model' >&2)
"$venv/bin/python" "$root/scripts/checks/exports_reference.py" "$work" "${fixture[@]}" 2> >(grep -v -e '| INFO' -e '| DEBUG' -e 'Loading weights' >&2)
say "dflash's forward against z-lab's, on this run's drafters"
DFLASH_ZLAB_FORWARD="$work/zlab-forward" DFLASH_ZLAB_FORWARD_SLIDING="$work/zlab-forward-sliding" \
  cargo test --quiet --test exports
say "dflash's DFlash 2 training step against speculators', and draft_model.init of the folder speculators wrote"
DFLASH_DFLASH2_SPECULATORS="$dflash2_out" cargo test --quiet --test dflash2 speculators
say "all checks passed"
