"""KV tensors as lynxkv passes them around: per-layer ``(keys, values)`` pairs and the dtypes a cache stores.

Every layer's keys and values are ``[kv_heads, tokens, head_dim]`` tensors (batch 1). ``transformers`` uses
``[batch, kv_heads, tokens, head_dim]`` and a ``Cache`` object: :func:`cache_to_kv` converts from it (without
importing ``transformers``), :func:`lynxkv.hf.kv_to_cache` back to it.
"""

from __future__ import annotations

import torch

from lynxkv.errors import InputError

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [H, T, D]

#: The element dtypes a cache can record, by the name the header and the CLI use.
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def cache_to_kv(cache) -> KVPairs:
    """A ``transformers`` cache (``DynamicCache``, batch 1) → per-layer ``(keys, values)`` ``[H, T, D]``.

    A sequence of per-layer pairs is returned as a list unchanged (``[H, T, D]`` or ``[1, H, T, D]`` tensors;
    :func:`lynxkv.encode_kv` checks them). lynxkv stores every prompt token in every layer, so a cache whose
    sliding-window layers have already dropped their oldest tokens is refused: build it with ``DynamicCache()``
    (no config: every layer keeps every token, the model's attention mask still applies the window) or with
    :func:`lynxkv.hf.prefill`. A batch larger than 1 is refused: encode one cache per sequence.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        if isinstance(cache, (str, bytes)) or not hasattr(cache, "__len__"):
            raise InputError(f"expected a transformers cache or per-layer (keys, values) pairs, got "
                             f"{type(cache).__name__}")
        return list(cache)
    pairs: KVPairs = []
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            raise InputError(f"cache layer {i} holds no [batch, kv_heads, tokens, head_dim] keys and values")
        if k.shape[0] != 1:
            raise InputError(f"cache layer {i} has batch {k.shape[0]}; lynxkv stores one sequence per cache "
                             f"(split the batch and encode each sequence on its own)")
        seen = int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else k.shape[2]
        if getattr(layer, "is_sliding", False) and seen > k.shape[2]:
            raise InputError(
                f"cache layer {i} is a sliding-window layer (window {getattr(layer, 'sliding_window', '?')}) that "
                f"keeps only the last {k.shape[2]} of {seen} tokens; lynxkv stores every token of every layer: "
                f"prefill into DynamicCache() without a config (or use lynxkv.hf.prefill)")
        pairs.append((k[0], v[0]))
    if not pairs:
        raise InputError("the cache holds no layers")
    return pairs


def resolve_device(device) -> torch.device:
    """``device`` (None: the CPU; a ``torch.device``, ``"cuda"``, ``"cuda:1"``, ``"cpu"`` ...) as a device that can
    hold the decoded tensors, or an :class:`InputError` that says why not: a name torch does not know, ``meta``
    (it holds no values), a backend this torch was built without or whose device is not there."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InputError(f"device: {device!r} is not a torch device name (cpu, cuda, cuda:1 ...)") from None
    if dev.type == "meta":
        raise InputError("device: 'meta' tensors hold no values; name a device that does (cpu, cuda ...)")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise InputError(f"device: {str(dev)!r} is not available (this torch sees {found} CUDA devices)")
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:  # a backend this build lacks (torch raises AssertionError for some)
        why = str(exc).split(". ")[0]
        raise InputError(f"device: {str(dev)!r} is not available ({why})") from None
    return dev
