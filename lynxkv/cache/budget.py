"""How much memory reading a cache may take: the refusal of a cache whose declared shape needs more than the
machine allows (:func:`check_decoded_size`), and the window of layers a streaming read or write holds
(:func:`default_window`, :func:`window_for_memory`), and what encoding a dump holds by default
(:data:`DEFAULT_ENCODE_MEMORY`)."""

from __future__ import annotations

import os

import torch

from lynxkv.errors import InputError
from lynxkv.format.headers import AnchorHeader, decoded_bytes
from lynxkv.quant.dispatch import concurrent_tensors

MAX_DECODED_ENV = "LYNXKV_MAX_DECODED_BYTES"

#: About how many bytes of a dump's layers :func:`lynxkv.cache.save_dump` (``lynxkv encode DUMP``) holds while it
#: encodes them, by default: pieces of whole pages (:func:`lynxkv.cache.encoded.piece_plan`).
DEFAULT_ENCODE_MEMORY = 256 << 20


def default_window() -> int:
    """Layers a streaming read or write holds at once by default: two, or one per CPU worker where there are more
    (:func:`lynxkv.quant.dispatch.concurrent_tensors`)."""
    return max(2, concurrent_tensors())


def window_for_memory(memory: int, layer_bytes: int) -> int:
    """The most layers of ``layer_bytes`` each that fit in ``memory`` bytes (a ``--memory`` bound); at least one
    must, or the bound is refused."""
    if layer_bytes > memory:
        raise InputError(f"memory: one layer of this cache takes about {layer_bytes:,} bytes, more than the "
                         f"{memory:,} allowed")
    return max(1, memory // max(layer_bytes, 1))


def max_decoded_bytes() -> int:
    """The most decoded bytes one cache may need (``$LYNXKV_MAX_DECODED_BYTES``; default: half the memory)."""
    text = os.environ.get(MAX_DECODED_ENV)
    if text:
        try:
            return int(float(text))
        except ValueError:
            raise InputError(f"${MAX_DECODED_ENV}: expected a number of bytes, got {text!r}") from None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def check_decoded_size(h: AnchorHeader, dtype: torch.dtype, *, anchor_only: bool = False,
                       layers: int | None = None) -> int:
    """Refuse, before anything is allocated, a cache whose declared shape needs more memory to load than
    :func:`max_decoded_bytes`: the output in ``dtype`` plus the codes (1 byte per element per segment) and the
    metadata, of every layer or of ``layers`` of them (what a reader holds at once). Returns the bytes it needs."""
    need = decoded_need(h, dtype, anchor_only=anchor_only, layers=layers)
    limit = max_decoded_bytes()
    if need > limit:
        held = "" if layers is None or layers >= h.layers else f" ({layers} at a time)"
        raise InputError(f"this cache declares {h.layers} layers{held} x {h.kv_heads} heads x {h.tokens} tokens x "
                         f"{h.head_dim} dims: {need:,} bytes to load, more than the limit of {limit:,} bytes "
                         f"(${MAX_DECODED_ENV} raises it)")
    return need


def decoded_need(h: AnchorHeader, dtype: torch.dtype, *, anchor_only: bool = False, layers: int | None = None) -> int:
    """The bytes :func:`check_decoded_size` counts: decoding every layer, or ``layers`` of them at once."""
    out = decoded_bytes(h, torch.empty((), dtype=dtype).element_size())
    codes = decoded_bytes(h, 1) * (1 if anchor_only else 2)
    meta = decoded_bytes(h, h.scheme.meta_bytes) * 2 // max(h.scheme.chunk, 1)
    need = out + codes + meta
    if layers is not None and h.layers:
        need = need * min(layers, h.layers) // h.layers
    return need
