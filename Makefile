# The two set-up commands of README.md. Both install what is missing first (scripts/setup.sh).
#   make run    builds dflash and runs it on the built-in default configuration
#   make test   checks formatting and lints, and runs the whole test suite
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
# The commit `dflash --version` names (only the binary's own crate is rebuilt when it changes).
export DFLASH_COMMIT := $(shell git describe --always --dirty --abbrev=12 2>/dev/null)

.PHONY: setup run test build check-exports check-readme check-ui gpu-bin

setup:
	@scripts/setup.sh

build: setup
	cargo build --release

run: build
	@echo "[run] dflash serve-train on the built-in default: the tiny-tasks target (trained, built in), 2 drafters, the built-in"
	@echo "[run] sample data, CPU unless a GPU is present; with config/make-run.toml (the tiny drafter's recipe: batch 2, Muon and AdamW at 3e-3,"
	@echo "[run] 6 epochs, decoded acceptance on the held-out prompts every 300 steps and at the end); a fresh run in runs/make-run"
	@echo "[run] (metrics: curl localhost:9410/metrics; Ctrl-C checkpoints and stops)"
	rm -rf runs/make-run
	./target/release/dflash serve-train --config config/make-run.toml
	@echo "[run] the exported drafter against greedy decoding, on 24 questions it never saw:"
	./target/release/dflash sample-data --count 24 --seed 777 --out runs/make-run/fresh.jsonl
	./target/release/dflash eval --decode --target tiny-tasks --drafter runs/make-run/final \
		--prompts runs/make-run/fresh.jsonl --max-new-tokens 96

test:
	@scripts/setup.sh --test
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	cargo test

# The drafter exports against the reference Python packages (speculators 0.9.0, z-lab's dflash 0.1.0); needs the
# network once for them. Not part of `make test` (CI has no Python packages); see docs/serving.md.
check-exports: setup
	@scripts/checks/check_exports.sh

# Every command block of README.md and docs/ marked CPU-runnable, run as written, twice (about 10 minutes on 2
# cores; not part of `make test`, which would then outgrow CI's budget; its last run is in BENCHMARKS.md).
check-readme: build
	scripts/checks/check_readme.sh

# The live page in headless Chromium (apt-get install chromium), with a fault injected; screenshots into docs/.
check-ui: build
	scripts/checks/check_ui.sh

# The binaries the GPU scripts carry (scripts/gpu/generate.sh): dflash and the library's tests, release, stripped and
# xz-compressed into .gpu-bin/ (a device call carries at most 64 MiB).
gpu-bin: build
	mkdir -p .gpu-bin
	strip -o .gpu-bin/dflash target/release/dflash
	strip -o .gpu-bin/test-lib $$(cargo test --release --lib --no-run --message-format=json | python3 -c \
		'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
	xz -f -T2 .gpu-bin/dflash .gpu-bin/test-lib
	ls -la .gpu-bin
