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


#: Tiny random configs of the architectures the model matrix covers: 2 layers, small hidden sizes, a 128-token
#: vocabulary; sliding windows shorter than the matrix's prompts, so that windowed layers really drop tokens.
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
SLIDING_WINDOW = 16


def make_tiny_model(arch: str, seed: int = 0, *, vocab: int = 128):
    """A random causal LM of ``arch`` (one of :data:`TINY_ARCHS`), in fp32."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  pad_token_id=0, bos_token_id=0, eos_token_id=1)
    hybrid = ["sliding_attention", "full_attention"]
    if arch == "llama":  # GQA with head_dim 128, as Llama 3
        cfg, cls = tf.LlamaConfig(**{**common, "head_dim": 128}), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":  # Qwen3-style layer_types: one sliding, one full layer
        cfg = tf.Qwen3Config(**common, use_sliding_window=True, sliding_window=SLIDING_WINDOW, layer_types=hybrid)
        cls = tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=SLIDING_WINDOW), tf.MistralForCausalLM
    elif arch == "gemma2":
        cfg, cls = tf.Gemma2Config(**common, sliding_window=SLIDING_WINDOW, layer_types=hybrid), tf.Gemma2ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, sliding_window=SLIDING_WINDOW, layer_types=hybrid)
        cls = tf.Gemma3ForCausalLM
    elif arch == "phi3":
        cfg, cls = tf.Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"}), tf.Phi3ForCausalLM
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    torch.manual_seed(seed)
    return cls(cfg).eval()
