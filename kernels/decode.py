"""Fused Triton decodes: packed 4+4 anchor (+ residual) + metadata -> KV ``[B, H, T, D]`` in place.

One program handles one chunk of C tokens of one (batch, head): it reads the packed bytes of the chunk as a
``[C, D/2]`` tile (byte j of a row holds channel 2j in the low nibble and 2j + 1 in the high nibble), spreads
the nibbles to a ``[C, D]`` tile in registers (join + reshape), reads the per-channel ``o`` and ``s``, and writes straight into a preallocated KV tensor in the HF layout and dtype
(any strides for B, H and T, so a slice of a larger cache works):

    full code:    v = a + ((r + 0.5) / R - 0.5)
    anchor only:  v = a                              (the centre of the anchor's residual sub-grid)
    x = o + s * (v * (2 / A) - 1)                    fp32, then one rounding to the output dtype

This is the reference dequantizer's sequence; with FMA contraction allowed the fp32 result may differ from it
by an ulp, which the tests' per-dtype tolerance states. Not supported: the α-law compander (use the
reference), splits other than 4+4, an odd head_dim, head_dim > 1024.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lynxkv.errors import InputError
from lynxkv.quant.scheme import Scheme

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _decode_kernel(
    a_ptr,  # [B, H*T*D/2] packed anchor bytes, contiguous
    r_ptr,  # [B, H*T*D/2] packed residual bytes (ignored when ANCHOR_ONLY)
    off_ptr,  # [B, H, NC, D] offsets (fp16 or fp32), contiguous
    scale_ptr,  # [B, H, NC, D] scales, contiguous
    out_ptr,  # [B, H, T, D] output KV, channel stride 1
    H, T, D, NC,  # sizes
    D2,  # D // 2, packed bytes per token row (a separate argument so Triton can see its alignment)
    sob, soh, sot,  # output strides (elements) of B, H, T
    CHUNK: tl.constexpr,  # C, tokens per chunk
    HALF_D: tl.constexpr,  # next power of two >= D / 2
    BLOCK_D: tl.constexpr,  # 2 * HALF_D: channels per tile
    ANCHOR_ONLY: tl.constexpr,  # decode from the anchor alone
    A: tl.constexpr,  # anchor steps
    R: tl.constexpr,  # residual levels
):
    bh = tl.program_id(0)
    ci = tl.program_id(1)
    b = bh // H
    h = bh % H
    t0 = ci * CHUNK
    rows = tl.arange(0, CHUNK)
    pairs = tl.arange(0, HALF_D)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < T - t0
    pmask = row_ok[:, None] & (pairs < D2)[None, :]  # [C, D/2]
    mask = row_ok[:, None] & (cols < D)[None, :]  # [C, D]

    byte = (bh.to(tl.int64) * T + t0 + rows[:, None]) * D2 + pairs[None, :]
    ab = tl.load(a_ptr + byte, mask=pmask, other=0).to(tl.int32)
    # byte j -> channels 2j (low nibble) and 2j + 1 (high nibble): join along a new last axis, then flatten
    v = tl.reshape(tl.join(ab & 15, ab >> 4), (CHUNK, BLOCK_D)).to(tl.float32)
    if not ANCHOR_ONLY:
        rb = tl.load(r_ptr + byte, mask=pmask, other=0).to(tl.int32)
        res = tl.reshape(tl.join(rb & 15, rb >> 4), (CHUNK, BLOCK_D)).to(tl.float32)
        v = v + ((res + 0.5) / R - 0.5)
    mrow = (bh.to(tl.int64) * NC + ci) * D
    o = tl.load(off_ptr + mrow + cols, mask=cols < D, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + mrow + cols, mask=cols < D, other=0.0).to(tl.float32)
    x = o[None, :] + s[None, :] * (v * (2.0 / A) - 1.0)

    dst = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + (t0 + rows[:, None]).to(tl.int64) * sot
    tl.store(dst + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


def supports(scheme: Scheme) -> bool:
    return scheme.compander == "linear" and scheme.grid == "nested" and scheme.anchor_bits == 4


def decode(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    offset: torch.Tensor,
    scale: torch.Tensor,
    scheme: Scheme,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode into ``out`` ``[B, H, T, D]`` (bf16/fp16/fp32, head_dim contiguous) in one launch.

    ``anchor``/``residual``: ``[B, H*T*D/2]`` packed 4+4 bytes (``residual=None``: anchor only), metadata
    ``[B, H, ceil(T/C), D]`` as written by :func:`lynxkv.kernels.encode.encode`. Returns ``out``.
    """
    if not supports(scheme):
        raise InputError("the Triton decode supports only the linear compander, nested grid, 4+4 split; use the reference")
    if out.dim() != 4 or out.dtype not in _OUT_DTYPES or out.stride(-1) != 1:
        raise InputError(
            f"out must be a [batch, kv_heads, tokens, head_dim] bf16/fp16/fp32 tensor with a contiguous head_dim, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    bsz, h, t, d = out.shape
    if d % 2 or d > 1024:
        raise InputError(f"head_dim must be even and at most 1024, got {d}")
    nc = -(-t // scheme.chunk)
    need = (bsz, h * t * d // 2)
    for name, buf in (("anchor", anchor), ("residual", residual)):
        if buf is not None and (tuple(buf.shape) != need or buf.dtype != torch.uint8 or not buf.is_contiguous()):
            raise InputError(f"{name}: expected contiguous uint8 {need}, got {tuple(buf.shape)} {buf.dtype}")
    for name, m in (("offset", offset), ("scale", scale)):
        if tuple(m.shape) != (bsz, h, nc, d) or not m.is_contiguous():
            raise InputError(f"{name}: expected contiguous {(bsz, h, nc, d)}, got {tuple(m.shape)}")
    devices = {anchor.device, offset.device, scale.device, out.device} | ({residual.device} if residual is not None else set())
    if len(devices) != 1:
        raise InputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out.numel() == 0:
        return out
    half_d = triton.next_power_of_2(d // 2)
    _decode_kernel[(bsz * h, nc)](
        anchor, anchor if residual is None else residual, offset, scale, out,
        h, t, d, nc, d // 2,
        out.stride(0), out.stride(1), out.stride(2),
        CHUNK=scheme.chunk, HALF_D=half_d, BLOCK_D=2 * half_d, ANCHOR_ONLY=residual is None,
        A=scheme.anchor_steps, R=scheme.residual_levels,
        num_warps=4 if scheme.chunk * half_d >= 512 else 1,
    )
    return out
