"""Shared fixtures: tiny random HF models built from a config (fast), and the real offline SmolLM2 (slow)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_tiny_llama(seed: int = 0, *, vocab: int = 128, layers: int = 2, kv_heads: int = 2, head_dim: int = 16):
    """A random Llama-architecture causal LM small enough to run hundreds of forwards per second on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=kv_heads * head_dim * 2,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads * 2,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_llama(0)


@pytest.fixture(scope="session")
def smollm2():
    """The offline SmolLM2-135M-Instruct (about 20 s to load); tests using it are marked ``slow``."""
    from lynxkv.errors import InputError
    from lynxkv.hf.models import load_model, smollm2_dir

    try:
        smollm2_dir()
    except InputError as exc:
        pytest.skip(str(exc))

    return load_model()
