#!/usr/bin/env bash
# Runs HERE, not on the GPU machine: fills the git-ignored folders that the device calls of scripts/gpu/*.sh carry,
# on a fresh checkout (each session's checkout starts without them). A call carries at most 64 MiB with the working
# tree (about 9 MB), so the real model's GGUF crosses in two parts, each beside what fits:
#   .gpu-bin/                    `make gpu-bin`: dflash and the library's tests, stripped and xz-compressed (14 MB)
#   .gpu/gguf.part-00            the GGUF's first 43,000,000 bytes: carried with .gpu-bin (`recipe.sh part`)
#   .gpu/gguf.part-01            the rest (55 MB): carried with .whl/gguf-*.whl (`recipe.sh model` or `data`)
#   .whl/gguf-0.19.0-*.whl       the GGUF reader transformers converts the model with
#   .whl/speculators/            with SPECULATORS=1: scripts/peers/speculators_wheels.sh (56 MB, carried alone)
#   .gpu/base/dflash-base.xz     with BASE=REV: that commit's dflash, built in a worktree sharing target/, for a
#                                before/after in one lease (carried alone, as .gpu-bin and part 00 fill a call; there,
#                                `cp .gpu/base/*.xz .gpu-bin/ && scripts/gpu/recipe.sh part` unpacks it beside the others)
# Needs `scripts/setup.sh --test` first (it leaves the GGUF in the per-user cache). Usage, from the checkout's root:
#   scripts/gpu/carry.sh                     BASE=a4ba349 SPECULATORS=1 scripts/gpu/carry.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=$HOME/.cargo/bin:$PATH
cache="${DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
gguf=$cache/wheels/SmolLM2-135M-Instruct.Q4_1.gguf
sha=$(sed -n 's/^real_model_gguf_sha=//p' scripts/gpu/prologue.sh)
say() { printf '[carry] %s\n' "$*" >&2; }

[ -f "$gguf" ] || { say "$gguf is missing: run scripts/setup.sh --test first"; exit 2; }
mkdir -p .gpu .whl
if ! cat .gpu/gguf.part-* 2>/dev/null | sha256sum | grep -q "^$sha "; then
  say "splitting the real model's GGUF into .gpu/gguf.part-00 (43,000,000 bytes) and -01"
  rm -f .gpu/gguf.part-*
  head -c 43000000 "$gguf" >.gpu/gguf.part-00
  tail -c +43000001 "$gguf" >.gpu/gguf.part-01
  cat .gpu/gguf.part-* | sha256sum | grep -q "^$sha " || { say "the parts do not join to SHA-256 $sha"; exit 1; }
fi
ls .whl/gguf-0.19.0-*.whl >/dev/null 2>&1 ||
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d .whl gguf==0.19.0
[ -z "${SPECULATORS:-}" ] || [ -d .whl/speculators ] || scripts/peers/speculators_wheels.sh

if [ -n "${BASE:-}" ]; then
  say "building dflash at $BASE (a worktree sharing target/) -> .gpu/base/dflash-base.xz"
  worktree=$(mktemp -d)
  git worktree add --detach "$worktree" "$BASE" >/dev/null
  ln -sfn "$(readlink -f .libtorch)" "$worktree/.libtorch"
  ln -sfn "$(readlink -f .venv)" "$worktree/.venv"
  CARGO_TARGET_DIR=$PWD/target DFLASH_COMMIT=$(git rev-parse --short=12 "$BASE") \
    cargo build --release --manifest-path "$worktree/Cargo.toml"
  mkdir -p .gpu/base
  strip -o .gpu/base/dflash-base target/release/dflash
  xz -f -T2 .gpu/base/dflash-base
  git worktree remove --force "$worktree"
  # The worktree's build wrote the library of the same package into the shared target/ with sources older than its
  # artifact, so cargo would take it as this checkout's (and the binary then fails to link): make it rebuild.
  touch src/lib.rs
fi
# Last, so that target/release/dflash is this checkout's again.
make gpu-bin
du -sh .gpu-bin .gpu/gguf.part-* .whl/* .gpu/base 2>/dev/null
