"""Shared helpers for the exact-tier tests: KV in each original dtype, and bit-for-bit comparison."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def exact_kv(dtype, *, layers=3, h=2, t=300, d=64, seed=0):
    """Per-layer ``(keys, values)`` ``[h, t, d]`` in ``dtype``, with per-channel scales and layers of growing size."""
    g = torch.Generator().manual_seed(seed)
    return [tuple((torch.randn(h, t, d, generator=g) * (1 + i) * torch.exp(torch.randn(1, 1, d, generator=g)))
                  .to(dtype) for _ in range(2)) for i in range(layers)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width (so that -0.0, 0.0 and NaN payloads compare exactly)."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def same_bits(a, b) -> bool:
    """Two KV lists of the same length whose every tensor has the same dtype and the same bits."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(bits(x), bits(y))
        for (xk, xv), (yk, yv) in zip(a, b) for x, y in ((xk, yk), (xv, yv)))
