#!/usr/bin/env bash
# Downloads speculators 0.9.0 and what it imports that the GPU machine's image lacks (its package list:
# the device tool's KINDS.md) as Python 3.12 wheels into .whl/speculators/ (git-ignored), for the peers that run
# speculators on the device: scripts/gpu/peer_step.sh (its DFlash step, ../shared/peer/spec_dflash_step.py) and
# scripts/gpu/synthesize.sh peer (its trainer). A device call carries them (`carry: [".whl/speculators"]`, about
# 55 MB), whose scripts install them (scripts/gpu/prologue.sh, `speculators_wheels`).
# Run here, from the checkout's root:  scripts/peers/speculators_wheels.sh
set -euo pipefail
dir=.whl/speculators
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# One version of each (two stop the install). The image has torch, transformers, numpy, pandas, aiohttp, httpx,
# huggingface-hub, rich, typer, click, tqdm, safetensors, psutil, protobuf, xxhash, fsspec and pyyaml.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" \
  speculators==0.9.0 hs-connectors==0.9.0 \
  datasets==5.1.0 pyarrow==24.0.0 dill==0.4.1 multiprocess==0.70.19 \
  openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.4 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.4 typing-extensions==4.16.0 \
  pydantic-settings==2.16.3 python-dotenv==1.2.2 loguru==0.7.3
du -sh "$dir"
ls "$dir"
