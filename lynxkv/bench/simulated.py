"""In-memory loads for experiments, examples and the ``--compare`` baselines.

:func:`split_kv` quantizes exact KV with the reference quantizer and returns what a ``.lynx`` reader would hand
out (anchor-only and full dequantized KV) with the bytes each stream carries. :func:`link_load` releases them
as an emulated link would: one link of ``bandwidth`` bytes/s and one-way ``latency`` s, the anchor sent first
and the residual right after it, so ``anchor at latency + A/bw`` and ``residual at latency + (A + R)/bw``. The
delays are real (a background thread waits them), so decoding and transfer overlap in wall-clock time.
"""

from __future__ import annotations

import math

import torch

from lynxkv.errors import InputError
from lynxkv.cache.kv import KVPairs
from lynxkv.cache.loading import PreparedLoad
from lynxkv.quant import dequantize, quantize
from lynxkv.quant.scheme import Scheme


def stream_bytes(kv: KVPairs, scheme: Scheme) -> tuple[int, int]:
    """(anchor bytes incl. per-chunk metadata, residual bytes) of ``kv`` packed under ``scheme``."""
    anchor = residual = 0
    for k, v in kv:
        for x in (k, v):
            h, t, d = x.shape
            n = h * t * d
            anchor += math.ceil(n * scheme.anchor_bits / 8) + 2 * h * math.ceil(t / scheme.chunk) * d * scheme.meta_bytes
            residual += math.ceil(n * scheme.residual_bits / 8)
    return anchor, residual


def bf16_bytes(kv: KVPairs) -> int:
    return sum(2 * (k.numel() + v.numel()) for k, v in kv)


def split_kv(kv: KVPairs, scheme: Scheme) -> tuple[KVPairs, KVPairs]:
    """(anchor-only KV, full-code KV), both fp32 ``[H, T, D]`` per layer, through the reference quantizer."""
    anchor_kv, full_kv = [], []
    for k, v in kv:
        ek, ev = quantize(k, scheme), quantize(v, scheme, "value")
        anchor_kv.append((dequantize(ek, scheme, anchor_only=True), dequantize(ev, scheme, anchor_only=True)))
        full_kv.append((dequantize(ek, scheme), dequantize(ev, scheme)))
    return anchor_kv, full_kv


def transfer_time(nbytes: int, bandwidth: float | None, latency: float | None) -> float:
    """Seconds to move ``nbytes`` over the emulated link (``bandwidth`` None: infinitely fast)."""
    if bandwidth is not None and bandwidth <= 0:
        raise InputError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    return (latency or 0.0) + (nbytes / bandwidth if bandwidth else 0.0)


def link_load(
    anchor_kv: KVPairs,
    full_kv: KVPairs | None,
    *,
    anchor_bytes: int,
    residual_bytes: int,
    bandwidth: float | None,
    latency: float | None = 0.0,
    prompt_token_ids: list[int] | None,
    model_fingerprint: str | None,
    residual_error: Exception | None = None,
) -> PreparedLoad:
    """A :class:`PreparedLoad` whose anchor and residual arrive as over one shared emulated link."""
    return PreparedLoad(
        anchor_kv,
        full_kv,
        anchor_delay=transfer_time(anchor_bytes, bandwidth, latency),
        residual_delay=transfer_time(anchor_bytes + residual_bytes, bandwidth, latency),
        residual_error=residual_error,
        prompt_token_ids=prompt_token_ids,
        model_fingerprint=model_fingerprint,
        anchor_bytes=anchor_bytes,
        residual_bytes=residual_bytes,
    )


def round_bf16(kv: KVPairs) -> KVPairs:
    """The KV as a BF16 transfer would deliver it (rounded to bf16, computed in fp32)."""
    return [(k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()) for k, v in kv]
