# The two set-up commands of README.md. Both install what is missing first (scripts/setup.sh).
#   make run    builds dflash and runs it on the built-in default configuration
#   make test   checks formatting and lints, and runs the whole test suite
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)

.PHONY: setup run test build

setup:
	@scripts/setup.sh

build: setup
	cargo build --release

run: build
	@echo "[run] dflash serve-train on the built-in default: the tiny target (random weights), 2 drafters, the built-in"
	@echo "[run] sample data, CPU unless a GPU is present, decoded acceptance every 50 steps; a fresh run in runs/make-run"
	@echo "[run] (metrics: curl localhost:9410/metrics; Ctrl-C checkpoints and stops)"
	rm -rf runs/make-run
	./target/release/dflash serve-train --set checkpoint.dir=runs/make-run --set eval.every_steps=50

test:
	@scripts/setup.sh --test
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	cargo test
