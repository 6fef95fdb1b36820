"""Prefill: run a prompt through a model and keep its KV cache, every token of every layer.

The prefill uses a ``DynamicCache()`` without a config, so sliding-window and hybrid-attention models (Mistral,
Gemma 2/3, Qwen3 ``layer_types``) keep every prompt token in every layer; their attention masks still apply the
window, so the logits are the model's own, and the stored cache always holds exactly the prompt's tokens.
"""

from __future__ import annotations

import functools
import inspect

import torch

from lynxkv.errors import InputError
from lynxkv.hf.attention import use_grouped_sdpa
from lynxkv.cache.kv import KVPairs, cache_to_kv


@torch.no_grad()
def prefill(model: "torch.nn.Module", input_ids: torch.Tensor) -> tuple[KVPairs, torch.Tensor]:
    """Run the prompt ``input_ids`` (``[T]`` or ``[1, T]``) through ``model``.

    Returns the KV cache as per-layer ``[H, T, D]`` tensors in the model's dtype and the logits of the last
    position ``[V]``.
    """
    from transformers import DynamicCache

    ids = input_ids.reshape(1, -1).to(model.device)
    if ids.shape[1] == 0:
        raise InputError("the prompt is empty")
    cache = DynamicCache()
    out = forward(model, ids, cache, logits_to_keep=1)  # not [T, vocab] logits: 17 GB for Gemma 3 at 16K tokens
    kv = cache_to_kv(cache)
    for i, (k, _) in enumerate(kv):
        if k.shape[1] != ids.shape[1]:
            raise InputError(f"layer {i} kept {k.shape[1]} of the prompt's {ids.shape[1]} tokens")
    return kv, out.logits[0, -1]


def continuation_ids(tokenizer, cached_ids: list[int], text: str) -> list[int]:
    """The token ids of ``text`` as a continuation of the cached prompt ``cached_ids``.

    ``text`` is either new text to append after the cached prompt, or a whole new prompt that starts with the
    cached prompt's text (then only its tail is new). The tail is tokenized in context when the tokenizer keeps
    the cached ids as a prefix of the whole text's ids, and on its own otherwise.
    """
    cached_text = tokenizer.decode(cached_ids, skip_special_tokens=False)
    if text.startswith(cached_text) and cached_text:
        text = text[len(cached_text):]
    if not text:
        raise InputError("the new prompt adds no text to the cached prompt")
    whole = tokenizer(cached_text + text, add_special_tokens=False).input_ids
    start = len(cached_ids)
    if whole[:start] == list(cached_ids) and len(whole) > start:
        return list(whole[start:])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise InputError("the new prompt tokenizes to zero tokens")
    return list(ids)


def forward(model: "torch.nn.Module", input_ids: torch.Tensor, cache, **options):
    """``model(input_ids, cache)`` with ``use_cache``: ``cache`` grows in place. The cache argument is named
    ``cache`` from transformers 5.20 and ``past_key_values`` before (a 5.19 model ignores ``cache=`` silently and
    would decode without the prompt). Attention runs through :func:`lynxkv.hf.attention.use_grouped_sdpa`.
    ``options`` go to the model (``logits_to_keep=1``: the last position's logits only)."""
    use_grouped_sdpa(model)
    return model(input_ids=input_ids, use_cache=True, **{_cache_argument(type(model)): cache}, **options)


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
