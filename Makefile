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
	@echo "[run] sample data, CPU unless a GPU is present; a fresh run in runs/make-run (Ctrl-C checkpoints and stops)"
	rm -rf runs/make-run
	./target/release/dflash serve-train --set checkpoint.dir=runs/make-run

test: setup
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	cargo test
