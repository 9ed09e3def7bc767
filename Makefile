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
	@echo "[run] dflash on the built-in default: the tiny target (random weights), CPU unless a GPU is present"
	./target/release/dflash bench --what target --profile

test: setup
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	cargo test
