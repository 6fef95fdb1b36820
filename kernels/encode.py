"""Fused Triton encode: KV ``[B, H, T, D]`` (HF layout, bf16/fp16/fp32) -> per-chunk metadata + codes.

One program handles one chunk of C tokens of one (batch, head) and all D channels: one coalesced ``[C, D]``
tile load; the pairs of channels that share a packed byte are separated in registers (reshape + split).
Per channel, in fp32, with the exact operation sequence of ``lynxkv.quant.reference`` (spec/FORMAT.md):

    centre = (max + min) * 0.5                  midrange; or the pinned tree sum / n for "mean"
    o      = fp32(meta(centre))                 meta() rounds to nearest even (fp16) or is exact (fp32)
    dev    = max(max - o, o - min)              = max |x - o| (rounding is monotone and symmetric)
    s      = fp32(meta_up(dev))                 the smallest metadata value >= dev
    u      = div_rn(x - o, s)                   correctly rounded division (s = 0 only when x - o = 0)
    v      = (u + 1) * (A / 2)
    a      = clamp(floor(v + 0.5), 0, A)        round half up, not Triton's round
    r      = clamp(floor((v - a + 0.5) * R), 0, R - 1)

then either packs 4+4 (two values per byte along D, the first in the low nibble, i.e. ``pack_bits`` over the
``[H, T, D]`` flattening of each batch item) or writes the unpacked anchor and residual bytes. Launched with
``enable_fp_fusion=False`` so that no step is contracted into an FMA.

Not supported (use the reference / fast CPU path): the α-law compander, packed output for splits other than
4+4 or an odd head_dim, head_dim > 1024.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lynxkv.errors import InputError
from lynxkv.quant.reference import META_TORCH_DTYPE, EncodedTensor
from lynxkv.quant.scheme import Scheme

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _encode_kernel(
    x_ptr,  # [B, H, T, D] input, channel stride 1
    off_ptr,  # [B, H, NC, D] metadata out (fp16 or fp32), contiguous
    scale_ptr,  # [B, H, NC, D] metadata out, contiguous
    a_ptr,  # PACK: [B, H*T*D/2] packed anchor bytes; else [B, H, T, D] anchor codes (uint8, contiguous)
    r_ptr,  # same for the residual
    H, T, D, NC,  # sizes
    D2,  # D // 2, packed bytes per token row (a separate argument so Triton can see its alignment)
    sxb, sxh, sxt,  # input strides (elements) of B, H, T
    CHUNK: tl.constexpr,  # C, tokens per chunk (power of two)
    LOG2_C: tl.constexpr,  # log2(C)
    HALF_D: tl.constexpr,  # next power of two >= ceil(D / 2): pairs of channels per tile
    BLOCK_D: tl.constexpr,  # 2 * HALF_D: channels per tile
    MEAN: tl.constexpr,  # centring: mean (tree sum) instead of midrange
    META_FP16: tl.constexpr,  # metadata dtype fp16 (else fp32)
    PACK: tl.constexpr,  # write packed 4+4 nibbles (else unpacked anchor/residual bytes)
    A: tl.constexpr,  # anchor steps, 2**anchor_bits - 1
    R: tl.constexpr,  # residual levels, 2**residual_bits
):
    bh = tl.program_id(0)  # b * H + h
    ci = tl.program_id(1)  # chunk index
    b = bh // H
    h = bh % H
    t0 = ci * CHUNK
    n = tl.minimum(T - t0, CHUNK)  # valid tokens in this chunk

    rows = tl.arange(0, CHUNK)  # [C]
    cols = tl.arange(0, BLOCK_D)  # [2 * D/2]
    row_ok = rows < n
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]  # [C, BLOCK_D]
    base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t0.to(tl.int64) * sxt
    x = tl.load(base + rows[:, None].to(tl.int64) * sxt + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    o, s = _chunk_meta(x, row_ok, n, base + (n - 1).to(tl.int64) * sxt + cols, col_ok, CHUNK, LOG2_C, BLOCK_D, MEAN, META_FP16)

    mrow = (bh.to(tl.int64) * NC + ci) * D
    if META_FP16:
        tl.store(off_ptr + mrow + cols, o.to(tl.float16), mask=col_ok)
        tl.store(scale_ptr + mrow + cols, s.to(tl.float16), mask=col_ok)
    else:
        tl.store(off_ptr + mrow + cols, o, mask=col_ok)
        tl.store(scale_ptr + mrow + cols, s, mask=col_ok)

    a, r = _codes(x, o, s, A, R)  # int32 [C, BLOCK_D]

    # element index inside the batch item's [H, T, D] flattening
    flat = (h.to(tl.int64) * T + t0 + rows[:, None]) * D  # [C, 1]
    if PACK:
        # byte (flat + 2j) / 2 holds channel 2j in the low nibble and 2j + 1 in the high one (D is even)
        a_lo, a_hi = tl.split(tl.reshape(a, (CHUNK, HALF_D, 2)))  # [C, D/2] each
        r_lo, r_hi = tl.split(tl.reshape(r, (CHUNK, HALF_D, 2)))
        pairs = tl.arange(0, HALF_D)
        pmask = row_ok[:, None] & (pairs < D2)[None, :]
        byte = (bh.to(tl.int64) * T + t0 + rows[:, None]) * D2 + pairs[None, :]  # = (b·H·T·D + flat) / 2 + j
        tl.store(a_ptr + byte, (a_lo | (a_hi << 4)).to(tl.uint8), mask=pmask)
        tl.store(r_ptr + byte, (r_lo | (r_hi << 4)).to(tl.uint8), mask=pmask)
    else:
        el = b.to(tl.int64) * (H * T * D) + flat + cols[None, :]
        tl.store(a_ptr + el, a.to(tl.uint8), mask=mask)
        tl.store(r_ptr + el, r.to(tl.uint8), mask=mask)


@triton.jit
def _chunk_meta(
    x, row_ok, n, last_ptr, col_ok,
    CHUNK: tl.constexpr, LOG2_C: tl.constexpr, W: tl.constexpr, MEAN: tl.constexpr, META_FP16: tl.constexpr,
):
    """(o, s) fp32 ``[W]`` of one ``[C, W]`` tile: the metadata values, already rounded to the meta dtype."""
    mx = tl.max(tl.where(row_ok[:, None], x, -float("inf")), axis=0)
    mn = tl.min(tl.where(row_ok[:, None], x, float("inf")), axis=0)
    if MEAN:
        # The reference pads a short chunk with its last token times 0 and sums by halving:
        # s[i] = s[i] + s[i + n/2] (a sum of two terms is exact in any order).
        zero = tl.load(last_ptr, mask=col_ok, other=0.0).to(tl.float32) * 0.0  # [W], keeps the sign of -0
        xs = tl.where(row_ok[:, None], x, zero[None, :])
        # A tree node is -0 exactly when both children are -0, so the reference's sum is -0 iff every term is
        # -0; Triton's reductions may start from +0, so restore that sign explicitly.
        neg_zero = ((xs == 0.0) & (xs.to(tl.int32, bitcast=True) < 0)).to(tl.int32)
        all_neg_zero = tl.min(neg_zero, axis=0) == 1  # [W]
        total = _tree_sum(xs, CHUNK, W, LOG2_C)
        total = tl.where(all_neg_zero, -tl.abs(total), total)
        centre = tl.math.div_rn(total, n.to(tl.float32))
    else:
        centre = (mx + mn) * 0.5
    if META_FP16:
        o = centre.to(tl.float16).to(tl.float32)  # round to nearest even
        dev = tl.maximum(mx - o, o - mn)
        hdev = dev.to(tl.float16)
        bumped = (hdev.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True)  # next fp16 up (dev >= 0)
        s = tl.where(hdev.to(tl.float32) < dev, bumped, hdev).to(tl.float32)
    else:
        o = centre
        s = tl.maximum(mx - o, o - mn)
    return o, s


@triton.jit
def _tree_sum(x, N: tl.constexpr, W: tl.constexpr, LOG2_N: tl.constexpr):
    """Sum over axis 0 of ``[N, W]`` by halving, the pinned order of ``reference.tree_sum``."""
    for i in tl.static_range(LOG2_N):
        # [2, N/2^(i+1), W]: row j -> (j // half, j % half), so the sum adds s[j] and s[j + half]
        x = tl.sum(tl.reshape(x, (2, N >> (i + 1), W)), axis=0)
    return tl.reshape(x, (W,))


@triton.jit
def _codes(x, o, s, A: tl.constexpr, R: tl.constexpr):
    """Anchor and residual (int32) of a ``[C, W]`` tile with per-channel fp32 ``o`` and ``s``."""
    s1 = tl.where(s > 0, s, 1.0)
    u = tl.math.div_rn(x - o[None, :], s1[None, :])
    v = (u + 1.0) * (A / 2.0)
    a = tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), A * 1.0)
    r = tl.minimum(tl.maximum(tl.floor((v - a + 0.5) * R), 0.0), R - 1.0)
    return a.to(tl.int32), r.to(tl.int32)


def supports(scheme: Scheme) -> bool:
    """The kernel handles the linear compander with either centring, any chunk, fp16/fp32 metadata."""
    return scheme.compander == "linear" and scheme.grid == "nested"


def _check(x: torch.Tensor, scheme: Scheme, pack: bool) -> None:
    if not supports(scheme):
        raise InputError("the Triton encode supports only the linear compander on the nested grid; use lynxkv.quant.quantize")
    if x.dim() != 4:
        raise InputError(f"expected a [batch, kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise InputError(f"expected bf16, fp16 or fp32 input, got {x.dtype}")
    if x.stride(-1) != 1:
        raise InputError("the head_dim axis must be contiguous (stride 1); other axes may be strided")
    if x.shape[-1] > 1024:
        raise InputError(f"head_dim up to 1024 is supported, got {x.shape[-1]}")
    if pack and (scheme.anchor_bits != 4 or x.shape[-1] % 2):
        raise InputError("packed output needs the 4+4 split and an even head_dim; use pack=False and pack_bits")
    if x.device.type != "cuda" and not _interpreting():
        raise InputError(f"the Triton encode runs on CUDA tensors (or under TRITON_INTERPRET=1), got {x.device}")


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def encode(
    x: torch.Tensor, scheme: Scheme, *, pack: bool = True, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode ``x`` ``[B, H, T, D]`` in one launch.

    Returns ``(anchor, residual, offset, scale)``: with ``pack`` the anchor/residual are ``[B, H*T*D/2]``
    packed bytes (4+4), else ``[B, H, T, D]`` uint8 codes; metadata ``[B, H, ceil(T/C), D]`` in the meta
    dtype. Each batch item equals the reference on its ``[H, T, D]`` slice. ``check_finite`` raises
    :class:`InputError` like the reference when the metadata overflows or the input is not finite (it reads
    only the small metadata back).
    """
    _check(x, scheme, pack)
    bsz, h, t, d = x.shape
    c = scheme.chunk
    nc = -(-t // c)
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    offset = torch.empty((bsz, h, nc, d), dtype=meta_dtype, device=x.device)
    scale = torch.empty((bsz, h, nc, d), dtype=meta_dtype, device=x.device)
    if pack:
        anchor = torch.empty((bsz, h * t * d // 2), dtype=torch.uint8, device=x.device)
        residual = torch.empty_like(anchor)
    else:
        anchor = torch.empty((bsz, h, t, d), dtype=torch.uint8, device=x.device)
        residual = torch.empty_like(anchor)
    if x.numel() == 0:
        return anchor, residual, offset, scale
    half_d = triton.next_power_of_2(-(-d // 2))
    grid = (bsz * h, nc)
    _encode_kernel[grid](
        x, offset, scale, anchor, residual,
        h, t, d, nc, d // 2,
        x.stride(0), x.stride(1), x.stride(2),
        CHUNK=c, LOG2_C=c.bit_length() - 1, HALF_D=half_d, BLOCK_D=2 * half_d, MEAN=scheme.centring == "mean", META_FP16=scheme.meta_dtype == "fp16",
        PACK=pack, A=scheme.anchor_steps, R=scheme.residual_levels,
        num_warps=4 if c * half_d >= 512 else 1,
        **_launch_options(),
    )
    if check_finite:
        if not bool(torch.isfinite(offset).all()):
            raise InputError(
                f"chunk centre overflows the {scheme.meta_dtype} metadata, or the tensor holds inf or NaN values"
            )
        if not bool(torch.isfinite(scale).all()):
            raise InputError(
                f"chunk range overflows the {scheme.meta_dtype} metadata, or the tensor holds inf or NaN values"
            )
    return anchor, residual, offset, scale


def _launch_options() -> dict:
    """``enable_fp_fusion=False`` on a real GPU (no FMA contraction); the interpreter takes no such option."""
    return {} if _interpreting() else {"enable_fp_fusion": False}


def quantize_triton(x: torch.Tensor, scheme: Scheme) -> EncodedTensor:
    """``lynxkv.quant.quantize`` for one ``[H, T, D]`` tensor on the GPU, bit for bit (same ``EncodedTensor``)."""
    if x.dim() != 3:
        raise InputError(f"expected a [kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise InputError("tensor holds inf or NaN values; only finite KV caches can be quantized")
    if x.dtype not in _IN_DTYPES:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    a, r, o, s = encode(x.unsqueeze(0), scheme, pack=False)
    return EncodedTensor(a[0], r[0], o[0], s[0])
