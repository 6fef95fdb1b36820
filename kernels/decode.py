"""Fused Triton decodes: packed 4+4 anchor (+ residual) + metadata -> KV ``[B, H, T, D]`` in place.

One program handles one chunk of C tokens of one (batch, head): it reads the packed bytes of the chunk as a
``[C, D/2]`` tile (byte j of a row holds channel 2j in the low nibble and 2j + 1 in the high nibble), spreads
the nibbles to a ``[C, D]`` tile in registers (join + reshape), reads the offsets and scales (per channel of
the chunk, or for values per channel, per token and group of C channels), and writes straight into
a preallocated KV tensor in the HF layout and dtype (any strides for B, H and T, so a slice of a larger cache
works). Every code goes through the reference's own level table ``û`` (``lynxkv.quant.reference
.expanded_levels``: 256 entries of the full code, then 16 of the anchor alone), so every compander and grid
decodes as the reference does:

    full code:    x = o + s * levels[a * R + r]
    anchor only:  x = o + s * levels[256 + a]      (the first SINKS tokens: from the full code)

in fp32, then one rounding to the output dtype. Compiled without FMA contraction (``enable_fp_fusion=False``)
this is the reference's value bit for bit. Rotated keys are decoded to fp32, rotated back on the
same device by :func:`lynxkv.quant.rotation.unrotate` (exactly rounded fp32 additions and power-of-two
scalings: the same bits on every device), then cast. Not supported: splits other than 4+4, an odd head_dim,
head_dim > 1024.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lynxkv.errors import InputError
from lynxkv.quant import rotation
from lynxkv.quant.reference import expanded_levels, split_code
from lynxkv.quant.scheme import Scheme

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FULL_LEVELS = 256  # entries of the full code in the level table; the anchor's follow


@triton.jit
def _decode_kernel(
    a_ptr,  # [B, H*T*D/2] packed anchor bytes, contiguous
    r_ptr,  # [B, H*T*D/2] packed residual bytes (read only for the full code or the sink tokens)
    off_ptr,  # [B, H, NC, D] offsets (fp16 or fp32), contiguous; CHANNEL_META: [B, H, T, G]
    scale_ptr,  # the scales, shaped as the offsets
    lev_ptr,  # [256 + 2**anchor_bits] fp32 level table: full codes, then anchor codes
    out_ptr,  # [B, H, T, D] output KV, channel stride 1
    H, T, D, NC, G,  # sizes (G: groups of C channels per token)
    D2,  # D // 2, packed bytes per token row (a separate argument so Triton can see its alignment)
    SINKS,  # leading tokens decoded from the full code also in anchor-only mode
    sob, soh, sot,  # output strides (elements) of B, H, T
    CHUNK: tl.constexpr,  # C, tokens per chunk (and channels per group for CHANNEL_META)
    HALF_D: tl.constexpr,  # next power of two >= D / 2
    BLOCK_D: tl.constexpr,  # 2 * HALF_D: channels per tile
    ANCHOR_ONLY: tl.constexpr,  # decode from the anchor alone
    CHANNEL_META: tl.constexpr,  # metadata per token and group of channels (values per channel)
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
    a = tl.reshape(tl.join(ab & 15, ab >> 4), (CHUNK, BLOCK_D))
    if ANCHOR_ONLY:
        sink = (t0 + rows) < SINKS  # [C]
        rb = tl.load(r_ptr + byte, mask=pmask & sink[:, None], other=0).to(tl.int32)
        r = tl.reshape(tl.join(rb & 15, rb >> 4), (CHUNK, BLOCK_D))
        code = tl.where(sink[:, None], a * R + r, 256 + a)
    else:
        rb = tl.load(r_ptr + byte, mask=pmask, other=0).to(tl.int32)
        code = a * R + tl.reshape(tl.join(rb & 15, rb >> 4), (CHUNK, BLOCK_D))
    lev = tl.load(lev_ptr + code, mask=mask, other=0.0)
    if CHANNEL_META:
        m = (bh.to(tl.int64) * T + t0 + rows[:, None]) * G + (cols // CHUNK)[None, :]
        o = tl.load(off_ptr + m, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + m, mask=mask, other=0.0).to(tl.float32)
    else:
        mrow = (bh.to(tl.int64) * NC + ci) * D
        o = tl.load(off_ptr + mrow + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        s = tl.load(scale_ptr + mrow + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    x = o + s * lev

    dst = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + (t0 + rows[:, None]).to(tl.int64) * sot
    tl.store(dst + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


def supports(scheme: Scheme) -> bool:
    """Every compander, grid, centring and grouping axis: the level table carries them; the 4+4 split only."""
    return scheme.anchor_bits == 4


@functools.lru_cache(maxsize=32)
def level_table(scheme: Scheme, device: torch.device) -> torch.Tensor:
    """The fp32 ``û`` of every full code, then of every anchor code, by the reference (``[256 + 2**a_b]``), on
    ``device``; built once per scheme and device (every decode call of a load reads it; nothing writes it)."""
    codes = torch.arange(FULL_LEVELS, dtype=torch.int32).to(torch.uint8)
    full = expanded_levels(*split_code(codes, scheme), scheme)
    anchor = expanded_levels(torch.arange(1 << scheme.anchor_bits, dtype=torch.uint8), None, scheme)
    return torch.cat([full, anchor]).to(device)


def decode(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    offset: torch.Tensor,
    scale: torch.Tensor,
    scheme: Scheme,
    out: torch.Tensor,
    *,
    kind: str = "key",
    anchor_only: bool | None = None,
    sinks: int = 0,
    rotated: bool | None = None,
) -> torch.Tensor:
    """Decode into ``out`` ``[B, H, T, D]`` (bf16/fp16/fp32, head_dim contiguous) in one launch.

    ``anchor``/``residual``: ``[B, H*T*D/2]`` packed 4+4 bytes; metadata ``[B, H, ceil(T/C), D]`` as written by
    :func:`lynxkv.kernels.encode.encode`, or ``[B, H, T, ceil(D/C)]`` for values grouped per channel
    (``kind="value"`` of such a scheme). ``anchor_only`` (default: ``residual is None``) decodes from the anchor
    alone, except the first ``sinks`` tokens, which then need ``residual`` (only their bytes are read).
    ``rotated`` (default: ``scheme.rotated(kind)``): the codes are of Hadamard-rotated keys, rotated back in fp32
    before the cast. Returns ``out``.
    """
    anchor_only = residual is None if anchor_only is None else anchor_only
    rotated = scheme.rotated(kind) if rotated is None else rotated
    if not supports(scheme):
        raise InputError("the Triton decode supports only the 4+4 split; use the reference")
    if out.dim() != 4 or out.dtype not in _OUT_DTYPES or out.stride(-1) != 1:
        raise InputError(
            f"out must be a [batch, kv_heads, tokens, head_dim] bf16/fp16/fp32 tensor with a contiguous head_dim, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    bsz, h, t, d = out.shape
    if d % 2 or d > 1024:
        raise InputError(f"head_dim must be even and at most 1024, got {d}")
    if residual is None and (not anchor_only or sinks):
        raise InputError("residual: needed for the full code and for the sink tokens")
    c = scheme.chunk
    nc, g = -(-t // c), -(-d // c)
    channel = scheme.axis(kind) == "channel"
    need = (bsz, h * t * d // 2)
    for name, buf in (("anchor", anchor), ("residual", residual)):
        if buf is not None and (tuple(buf.shape) != need or buf.dtype != torch.uint8 or not buf.is_contiguous()):
            raise InputError(f"{name}: expected contiguous uint8 {need}, got {tuple(buf.shape)} {buf.dtype}")
    meta_shape = (bsz, h, t, g) if channel else (bsz, h, nc, d)
    for name, m in (("offset", offset), ("scale", scale)):
        if tuple(m.shape) != meta_shape or not m.is_contiguous():
            raise InputError(f"{name}: expected contiguous {meta_shape}, got {tuple(m.shape)}")
    devices = {anchor.device, offset.device, scale.device, out.device} | ({residual.device} if residual is not None else set())
    if len(devices) != 1:
        raise InputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out.numel() == 0:
        return out
    half_d = triton.next_power_of_2(d // 2)
    target = torch.empty(out.shape, dtype=torch.float32, device=out.device) if rotated else out  # ŷ, then x̂
    _decode_kernel[(bsz * h, nc)](
        anchor, anchor if residual is None else residual, offset, scale, level_table(scheme, out.device), target,
        h, t, d, nc, g, d // 2, min(sinks, t) if anchor_only else 0,
        target.stride(0), target.stride(1), target.stride(2),
        CHUNK=c, HALF_D=half_d, BLOCK_D=2 * half_d, ANCHOR_ONLY=anchor_only, CHANNEL_META=channel,
        R=scheme.residual_levels,
        num_warps=4 if c * half_d >= 512 else 1,
        **_launch_options(),
    )
    if rotated:
        out.copy_(rotation.unrotate(target))
    return out


def _launch_options() -> dict:
    """``enable_fp_fusion=False`` on a real GPU (no FMA contraction: the reference's rounding); the interpreter
    takes no such option."""
    import os

    return {} if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else {"enable_fp_fusion": False}
