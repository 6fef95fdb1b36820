"""lynxkv KV ↔ ``transformers`` caches, so that ``model.generate`` and a serving loop can use a stored cache.

    import lynxkv
    from lynxkv.hf import to_dynamic_cache

    lynxkv.save_cache("doc.lynx", dynamic_cache, prompt_token_ids=ids)   # a DynamicCache goes in as it is
    with lynxkv.open_cache("doc.lynx") as cache:
        past = to_dynamic_cache(cache, model, anchor_only=False)         # [1, H, T, D] layers, model dtype
    model.generate(torch.tensor([ids + question_ids]), past_key_values=past, max_new_tokens=32)

The caches built here keep every token in every layer (plain ``DynamicLayer`` s, also for sliding-window and
hybrid-attention models: the model's attention mask applies the window, so the attention is the model's own),
which is what lets the speculative runner drop rejected drafts with ``crop``. ``generate`` needs at least one
input token that is not in the cache: to continue the cached prompt itself, ``crop(-1)`` the cache and pass the
whole prompt (the runner does the same: it re-feeds the last prompt token).
"""

from __future__ import annotations

import functools

import torch

from lynxkv.cache.kv import KVPairs


def kv_to_cache(kv: KVPairs, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None):
    """Per-layer ``[H, T, D]`` tensors → a ``transformers`` ``DynamicCache`` (batch 1), converted to ``dtype``
    and ``device`` when given (no copy when they already match: the layers are views of ``kv``).

    The layers hold the tensors themselves: ``DynamicCache(ddp_cache_data=...)`` would copy every layer into new
    storage (its ``update`` concatenates onto an empty tensor; 0.3 s for 3,000 tokens of SmolLM2 in fp32, paid
    before the first draft and again before the verify pass). Sharing is safe because a ``DynamicLayer`` never
    writes into its tensors: a forward appends by ``torch.cat`` into new storage, ``crop`` slices, and ``reset``
    drops them; with a transformers release whose ``reset`` still zeroes them in place (checked once), the
    layers get copies."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    data = []
    for k, v in kv:
        k, v = k.to(dtype=dtype or k.dtype, device=device), v.to(dtype=dtype or v.dtype, device=device)
        data.append((k.unsqueeze(0), v.unsqueeze(0)))
    if not _layers_leave_their_tensors_alone():
        return DynamicCache(ddp_cache_data=data)
    cache = DynamicCache(ddp_cache_data=[(k[..., :0, :], v[..., :0, :]) for k, v in data])  # dtype, device: no copy
    for layer, (k, v) in zip(cache.layers, data):
        if type(layer) is DynamicLayer and layer.is_initialized:
            layer.keys, layer.values = k, v
        else:  # a layer kind this does not know: let it take the tensors its own way
            layer.update(k, v)
    return cache


@functools.lru_cache(maxsize=None)
def _layers_leave_their_tensors_alone() -> bool:
    """Whether this transformers' ``DynamicLayer.reset`` leaves the tensors a layer held as they were (it drops
    them; releases before it zeroed them in place): tried once on a layer holding a one-element tensor."""
    from transformers.cache_utils import DynamicLayer

    held = torch.ones(1, 1, 1, 1)
    layer = DynamicLayer()
    layer.update(held[..., :0, :], held[..., :0, :])
    layer.keys = layer.values = held
    layer.reset()
    return bool(held.item() == 1)


def to_dynamic_cache(cache_or_kv, model=None, *, anchor_only: bool = False, dtype: torch.dtype | None = None):
    """A ``DynamicCache`` for ``model.generate(past_key_values=...)`` from an open :class:`lynxkv.LynxCache` (full
    code, or the anchor alone with ``anchor_only``) or from per-layer KV pairs.

    The stored dtype and the compute dtype are independent: the cache is converted to ``dtype``, else to the
    model's dtype and device, else kept as stored.
    """
    if hasattr(cache_or_kv, "load_kv"):
        kv = cache_or_kv.load_kv(anchor_only=anchor_only)
    elif anchor_only:
        raise TypeError("anchor_only needs an open lynxkv cache, not KV tensors")
    else:
        kv = cache_or_kv
    device = None
    if model is not None:
        dtype = dtype or model.dtype
        device = model.device
    return kv_to_cache(kv, dtype=dtype, device=device)
