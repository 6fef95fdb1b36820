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


#: Prompt tokens per forward of a long prefill: attention then holds ``[heads, chunk, context]`` scores, not
#: ``[heads, T, T]`` (16 GB for Gemma 3's four heads at 32K tokens in fp32).
PREFILL_CHUNK = 2048


@torch.no_grad()
def prefill(model: "torch.nn.Module", input_ids: torch.Tensor, *,
            chunk: int | None = PREFILL_CHUNK) -> tuple[KVPairs, torch.Tensor]:
    """Run the prompt ``input_ids`` (``[T]`` or ``[1, T]``) through ``model``, ``chunk`` tokens per forward (None:
    all at once; a prompt of at most ``chunk`` tokens is one forward either way). Each chunk attends to the cache of
    the ones before it: the same cache and logits as one forward, up to floating-point rounding.

    Returns the KV cache as per-layer ``[H, T, D]`` tensors in the model's dtype and the logits of the last
    position ``[V]``.
    """
    from transformers import DynamicCache

    ids = input_ids.reshape(1, -1).to(model.device)
    if ids.shape[1] == 0:
        raise InputError("the prompt is empty")
    if chunk is not None and chunk < 1:
        raise InputError(f"chunk: expected >= 1 tokens, got {chunk}")
    step = ids.shape[1] if chunk is None else chunk
    cache = DynamicCache()
    for start in range(0, ids.shape[1], step):
        # the last position's logits only, not [T, vocab]: 17 GB for Gemma 3 at 16K tokens
        out = forward(model, ids[:, start : start + step], cache, logits_to_keep=1)
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
