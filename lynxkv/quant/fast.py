"""The fast CPU path: bit-identical to :mod:`lynxkv.quant.reference`, several times faster.

Why it is fast (and still exact):

- **Statistics without a per-element pass.** Rounding is monotone and symmetric, so
  ``max_i |fl(x_i - o)| = max(fl(max(x) - o), fl(o - min(x)))``: the scale comes from the chunk's max and min
  (``amax``/``amin`` of the block's fp32 copy) instead of a full ``|x - o|`` pass.
- **Fewer per-element steps, proven equal.** For the companded ``z`` (``u`` itself for the linear compander)
  ``v = fl(fl(z + 1) * A/2)`` lies in ``[0, A]``, and with ``w = R·v`` (exact, R is a power of two, and
  ``fl(y·A/2)·R = fl(y·A·R/2)``) the pinned two-step rounding ``a = floor(v + 0.5)``,
  ``r = floor((v - a + 0.5)·R)`` collapses to

      code = a·R + r = floor(min(fl(w + R/2), R)) + floor(max(w, R/2)) - R/2

  For ``v >= 0.5`` the subtraction ``v - a`` is exact (Sterbenz) and so is the ``+ 0.5``, so the code is the
  real ``floor(w) + R/2``; below ``v = 0.5`` the anchor is 0 (or 1 when ``v + 0.5`` rounds up to 1) and the
  code is ``floor(fl(w + R/2))``, the one rounding the reference performs there. The identity was checked
  exhaustively over every fp32 ``v`` in ``[0, A]`` for the 4+4 split (``benchmarks/check_code_identity.py``)
  and is re-checked on the boundary neighbourhoods by the tests.
- **Blocks that stay in cache.** Chunks are processed a few at a time into preallocated fp32 buffers with
  in-place ops, so each step reads and writes L2/L3, not DRAM, and no ``[H, nc, C, D]`` padded copy is made.
- **Packing on 16-bit words.** Two codes along D are one little-endian ``int16`` word ``lo | hi << 8``; the
  anchor byte is ``(lo >> 4) | (hi & 0xF0)`` and the residual byte ``(lo & 0x0F) | (hi << 4)``.
- **Both cores.** Blocks are independent; they run on a small thread pool (``LYNXKV_CPU_THREADS``, default the
  torch thread count), each worker with one intra-op thread (torch releases the GIL inside ops).

Every nested-grid scheme takes the fast path (any anchor/residual split). The α-law compander calls the
reference's own :func:`~lynxkv.quant.reference.compand` (float64 ``log1p``, rounded once to fp32) on each block,
so its ``z`` is the reference's; it costs most of the encode time of a companded scheme. The uniform grid uses
the reference. Decoding is a per-(chunk, channel) affine map of the code, ``x̂ = B + K·code`` (linear), or
``x̂ = o + s·levels[code]`` through a 256-entry table of expanded levels (α-law), within the tolerances stated in
the tests (it is not bit-identical to the reference dequantizer, which nobody needs).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from lynxkv.errors import InputError
from lynxkv.quant.pack import pack_bits, packed_size, unpack_bits
from lynxkv.quant.reference import (
    EncodedTensor,
    META_TORCH_DTYPE,
    compand,
    dequantize,
    expand,
    quantize,
    tree_sum,
)
from lynxkv.quant.scheme import Scheme

#: Elements per block of the per-element pass (fp32 buffers of 4 bytes each stay in L2/L3).
BLOCK_ELEMENTS = 1 << 20

QuantizeFn = Callable[[torch.Tensor, Scheme], EncodedTensor]


def supports(scheme: Scheme) -> bool:
    """Whether the fast path applies (the nested grid, either compander); the uniform grid falls back to the
    reference."""
    return scheme.grid == "nested"


# ----------------------------------------------------------------------------------------------- encode
class _Workspace:
    """Preallocated buffers for one block, reused across blocks: a fresh multi-megabyte tensor per op costs
    page faults that are slower than the op itself."""

    def __init__(self, cap: int) -> None:
        self.xf = torch.empty(cap, dtype=torch.float32)  # the block in fp32, then w
        self.p = torch.empty(cap, dtype=torch.float32)  # second fp32 operand, then the code as a float
        self.i = torch.empty(cap, dtype=torch.int32)  # the code as int32 (fp32 -> uint8 has no fast cast)
        self.codes = torch.empty(cap, dtype=torch.uint8)  # the 8-bit codes
        half = (cap + 1) // 2
        self.w1 = torch.empty(half, dtype=torch.int16)  # packing scratch: one int16 word per pair along D
        self.w2 = torch.empty(half, dtype=torch.int16)
        self.w3 = torch.empty(half, dtype=torch.int16)


def _meta_from_stats(
    mx: torch.Tensor, mn: torch.Tensor, centre: torch.Tensor | None, scheme: Scheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """``offset`` and ``scale`` (metadata dtype) from fp32 chunk max/min (and the mean, for ``mean``).

    Rounding is monotone and symmetric, so ``max_i |fl(x_i - o)| = max(fl(max - o), fl(o - min))``: no
    per-element ``|x - o|`` pass is needed to get the reference's ``dev``.
    """
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    if centre is None:
        centre = (mx + mn) * 0.5
    offset = centre.to(meta_dtype)
    o = offset.float()
    # a NaN or inf input makes max/min, hence the centre, non-finite: one check covers both, then diagnose
    if not _all_finite(o):
        if not (_all_finite(mx) and _all_finite(mn)):
            raise InputError("tensor holds inf or NaN values; only finite KV caches can be quantized")
        raise InputError(f"chunk centre overflows the {scheme.meta_dtype} metadata; values are too large")
    dev = torch.maximum(mx - o, o - mn)
    if meta_dtype == torch.float32:
        scale = dev
    else:  # meta_round_up without its data-dependent branch: bump the fp16 bits by one where it rounded down
        h = dev.to(meta_dtype)
        bump = (h.float() < dev).to(torch.int16)
        scale = (h.view(torch.int16) + bump).view(meta_dtype)
    if not _all_finite(scale.float()):
        raise InputError(f"chunk range overflows the {scheme.meta_dtype} metadata; values are too large")
    return offset, scale


def _all_finite(t: torch.Tensor) -> bool:
    """``isfinite(t).all()``, via one sum on the common path (a finite sum means every term is finite)."""
    total = float(t.sum(dtype=torch.float64))
    return math.isfinite(total) or bool(torch.isfinite(t).all())


def code_from_w(w: torch.Tensor, levels: int, out: torch.Tensor) -> torch.Tensor:
    """The 8-bit code as an exact fp32 integer from ``w = R·v`` (``levels`` = R); ``w`` is clobbered.

    ``code = floor(min(fl(w + R/2), R)) - R/2 + floor(max(w, R/2))``, equal to the reference's
    ``a·R + r`` for every fp32 ``v`` in ``[0, A]`` (module docstring).
    """
    half_r = float(levels // 2)
    torch.add(w, half_r, out=out).clamp_(max=float(levels)).floor_().sub_(half_r)
    return out.add_(w.clamp_(min=half_r).floor_())


def _encode_block(
    xb: torch.Tensor,  # [H, n, C', D] input block (a view of the caller's tensor), any float dtype
    valid: int,  # valid tokens per chunk (C' == C for whole chunks; < C only for the tail chunk)
    scheme: Scheme,
    ws: _Workspace,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunk metadata and 8-bit codes of one block: ``(offset [H,n,D], scale [H,n,D], codes [H,n,C',D] u8)``.

    Per element (fp32): ``w = fl(fl((x - o) / s + 1) · A·R/2)``, then
    ``code = floor(min(fl(w + R/2), R)) - R/2 + floor(max(w, R/2))`` (see the module docstring).
    """
    h, n, cb, d = xb.shape
    k = xb.numel()
    c = scheme.chunk
    xf = ws.xf[:k].view(h, n, cb, d)
    xf.copy_(xb)
    mx = xf.amax(dim=2)  # [H, n, D]
    mn = xf.amin(dim=2)
    centre = None
    if scheme.centring == "mean":
        if cb == c:
            centre = tree_sum(xf, dim=2) / torch.tensor(float(c))
        else:  # the reference pads with the last token times 0 (keeping the sign of an all -0 chunk)
            padded = torch.cat([xf, (xf[:, :, -1:] * 0.0).expand(h, n, c - cb, d)], dim=2)
            centre = tree_sum(padded, dim=2) / torch.tensor(float(valid))
    offset, scale = _meta_from_stats(mx, mn, centre, scheme)
    o = offset.float().unsqueeze(2)  # [H, n, 1, D]
    s = scale.to(torch.float32, copy=True)  # a copy even for fp32 metadata: it is modified in place
    s = s.add_(s == 0).unsqueeze(2)  # s = 0 only when x - o = 0: dividing by 1 gives u = 0 as specified
    p = ws.p[:k].view(h, n, cb, d)
    xf.sub_(o).div_(s)  # u = (x - o) / s, correctly rounded
    if scheme.compander != "linear":
        xf.copy_(compand(xf, scheme))  # z: the reference's own function, so the same bits
    xf.add_(1.0).mul_(scheme.anchor_steps * scheme.residual_levels / 2.0)  # w = R·fl((u + 1)·A/2), exact scaling
    code_from_w(xf, scheme.residual_levels, p)
    codes = ws.codes[:k].view(h, n, cb, d)
    codes.copy_(ws.i[:k].view(h, n, cb, d).copy_(p))  # fp32 -> int32 -> uint8 (the vectorised casts)
    return offset, scale, codes


def _encode_pass(x: torch.Tensor, scheme: Scheme, sink) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` ``[H, T, D]`` block by block; ``sink(t0, t1, codes [H, t1-t0, D], ws)`` consumes codes.

    Blocks are independent (disjoint outputs), so they run on the worker threads. Returns the metadata
    ``(offset, scale)`` ``[H, ceil(T/C), D]``.
    """
    h, t, d = x.shape
    c = scheme.chunk
    nc = -(-t // c)
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    offset = torch.empty((h, nc, d), dtype=meta_dtype)
    scale = torch.empty((h, nc, d), dtype=meta_dtype)
    nfull = t // c
    step = _step(nc, h * c * d)

    def job(c0: int, c1: int, cb: int) -> None:
        ws = _workspace(step * h * c * d)
        t0 = c0 * c
        xb = x[:, t0 : t0 + (c1 - c0) * cb].unflatten(1, (c1 - c0, cb))  # [H, n, C', D] view, no copy
        off, sc, codes = _encode_block(xb, cb if cb == c else t - t0, scheme, ws)
        offset[:, c0:c1] = off
        scale[:, c0:c1] = sc
        sink(t0, t0 + (c1 - c0) * cb, codes.view(h, (c1 - c0) * cb, d), ws)

    spans = [(c0, min(nfull, c0 + step), c) for c0 in range(0, nfull, step)]
    if nfull < nc:
        spans.append((nfull, nc, t - nfull * c))
    _run(job, spans)
    return offset, scale


_LOCAL = threading.local()
_POOL: ThreadPoolExecutor | None = None


def _workers() -> int:
    """Worker threads for the block loop: ``LYNXKV_CPU_THREADS``, else the caller's intra-op thread count
    (as it was before :func:`_single_thread` lowered it to 1), at most 8."""
    env = os.environ.get("LYNXKV_CPU_THREADS")
    if env and env.isdigit():
        return max(1, int(env))
    return max(1, min(8, getattr(_LOCAL, "outer_threads", None) or torch.get_num_threads()))


def _step(nc: int, per_chunk: int) -> int:
    """Chunks per block: about ``BLOCK_ELEMENTS``, but at least one block per worker when there is work."""
    step = max(1, BLOCK_ELEMENTS // per_chunk)
    return max(1, min(step, -(-nc // _workers())))


def _workspace(cap: int) -> "_Workspace":
    ws = getattr(_LOCAL, "ws", None)
    if ws is None or ws.xf.numel() < cap:
        ws = _LOCAL.ws = _Workspace(cap)
    return ws


def _run(job, spans) -> None:
    """Run ``job(*span)`` for every span: inline for one span or one worker, else on the thread pool (each
    worker runs torch with one intra-op thread; torch releases the GIL inside ops)."""
    global _POOL
    n = _workers()
    if n == 1 or len(spans) <= 1:
        for span in spans:
            job(*span)
        return
    if _POOL is None or _POOL._max_workers != n:  # noqa: SLF001 - resize when the setting changes
        _POOL = ThreadPoolExecutor(max_workers=n, initializer=torch.set_num_threads, initargs=(1,))
    for fut in [_POOL.submit(job, *span) for span in spans]:
        fut.result()


def _single_thread(fn):
    """Run ``fn`` with one intra-op thread: its blocks are small and in cache, and an OpenMP fork/join per op
    costs more than it gains (and stalls badly when the machine is busy)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        if n == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        _LOCAL.outer_threads = n  # what _workers() sizes the pool by
        try:
            return fn(*args, **kwargs)
        finally:
            _LOCAL.outer_threads = None
            torch.set_num_threads(n)

    return wrapper


@_single_thread
def chunk_meta(x: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(head, chunk, channel) ``offset`` and ``scale`` of ``x`` ``[H, T, D]``, bit-identical to the reference."""
    _check_shape(x)
    return _encode_pass(x, scheme, lambda *a: None)


@_single_thread
def quantize_fast(x: torch.Tensor, scheme: Scheme) -> EncodedTensor:
    """Same result as :func:`lynxkv.quant.quantize` (bit for bit), faster on CPU for nested-grid schemes."""
    if not supports(scheme):
        return quantize(x, scheme)
    _check_shape(x)
    h, t, d = x.shape
    if t == 0 or x.numel() == 0 or x.device.type != "cpu":
        return quantize(x, scheme)
    x = x.contiguous() if x.stride(-1) != 1 else x
    anchor = torch.empty((h, t, d), dtype=torch.uint8)
    residual = torch.empty((h, t, d), dtype=torch.uint8)
    rb, mask = scheme.residual_bits, scheme.residual_levels - 1

    def sink(t0: int, t1: int, codes: torch.Tensor, ws: _Workspace) -> None:
        torch.bitwise_right_shift(codes, rb, out=anchor[:, t0:t1])
        torch.bitwise_and(codes, mask, out=residual[:, t0:t1])

    offset, scale = _encode_pass(x, scheme, sink)
    return EncodedTensor(anchor, residual, offset, scale)


@_single_thread
def encode_packed_fast(x: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize and pack in one pass: ``(anchor_packed, residual_packed, offset, scale)``.

    The packed tensors equal ``pack_bits(quantize(x).anchor, anchor_bits)`` and the residual likewise. The
    fused path needs 4+4 and an even head_dim (pairs along D); anything else quantizes then packs.
    """
    if not (supports(scheme) and scheme.anchor_bits == 4 and x.dim() == 3 and x.shape[-1] % 2 == 0):
        enc = quantize_fast(x, scheme)
        return (
            pack_bits(enc.anchor, scheme.anchor_bits),
            pack_bits(enc.residual, scheme.residual_bits),
            enc.offset,
            enc.scale,
        )
    _check_shape(x)
    h, t, d = x.shape
    if t == 0 or x.device.type != "cpu":
        enc = quantize(x, scheme)
        return pack_bits(enc.anchor, 4), pack_bits(enc.residual, 4), enc.offset, enc.scale
    x = x.contiguous() if x.stride(-1) != 1 else x
    anchor = torch.empty((h, t, d // 2), dtype=torch.uint8)
    residual = torch.empty((h, t, d // 2), dtype=torch.uint8)

    def sink(t0: int, t1: int, codes: torch.Tensor, ws: _Workspace) -> None:
        m = codes.numel() // 2
        word = codes.view(torch.int16)  # [H, n, D/2]: lo | hi << 8 (little-endian pairs along D)
        _pack_words(word, anchor[:, t0:t1], residual[:, t0:t1], *(b[:m].view(word.shape) for b in (ws.w1, ws.w2)))

    offset, scale = _encode_pass(x, scheme, sink)
    return anchor.view(-1), residual.view(-1), offset, scale


def _pack_words(word, anchor_out, residual_out, t1, t2) -> None:
    """Split int16 words ``lo | hi << 8`` of two 8-bit codes into packed 4+4 anchor and residual bytes:
    anchor ``(lo >> 4) | (hi & 0xF0)``, residual ``(lo & 0x0F) | ((hi & 0x0F) << 4)``.

    With ``y = word & 0xF0F0`` the anchor is the low byte of ``(y >> 4) | (y >> 8)``; with ``z = word & 0x0F0F``
    the residual is the low byte of ``z | (z >> 4)`` (the int16 -> uint8 cast keeps the low byte)."""
    torch.bitwise_and(word, _I16_F0F0, out=t1)
    torch.bitwise_right_shift(t1, 8, out=t2)
    anchor_out.copy_(t2.bitwise_or_(t1.bitwise_right_shift_(4)))
    torch.bitwise_and(word, 0x0F0F, out=t1)
    torch.bitwise_right_shift(t1, 4, out=t2)
    residual_out.copy_(t2.bitwise_or_(t1))


_I16_F0F0 = 0xF0F0 - 0x10000  # the bit pattern 0xF0F0 as a signed int16


@_single_thread
def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`lynxkv.quant.pack_bits`, with a word-wise fast path for 4 bits."""
    flat = values.reshape(-1)
    if bits != 4 or flat.numel() % 2 or flat.dtype != torch.uint8:
        return pack_bits(values, bits)
    word = flat.contiguous().view(torch.int16)
    return ((word & 0x0F) | ((word >> 4) & 0xF0)).to(torch.uint8)


@_single_thread
def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """:func:`lynxkv.quant.unpack_bits`, with an int16-word fast path for 4 bits."""
    if bits != 4 or count % 2 or not isinstance(packed, torch.Tensor) or packed.numel() != packed_size(count, 4):
        return unpack_bits(packed, bits, count)
    p = packed.reshape(-1).to(torch.int16)
    word = (p & 0x0F) | ((p & 0xF0) << 4)  # lo nibble -> byte 0, hi nibble -> byte 1
    return word.view(torch.uint8)


# ----------------------------------------------------------------------------------------------- decode
def _affine(offset: torch.Tensor, scale: torch.Tensor, scheme: Scheme, anchor_only: bool):
    """``x̂ = B + K·q`` with ``q`` the full code (or the anchor): returns ``(B, K)`` fp32 ``[H, nc, 1, D]``.

    Full code: ``v̂ = (code + 0.5)/R - 0.5``, ``x̂ = o + s·(2v̂/A - 1)`` so ``K = 2s/(A·R)`` and
    ``B = o - s·(1 + (R - 1)/(A·R))``. Anchor only: ``K = 2s/A``, ``B = o - s``.
    """
    a_steps = float(scheme.anchor_steps)
    r = float(scheme.residual_levels)
    o = offset.float().unsqueeze(2)
    s = scale.float().unsqueeze(2)
    if anchor_only:
        return o - s, s * (2.0 / a_steps)
    return o - s * (1.0 + (r - 1.0) / (a_steps * r)), s * (2.0 / (a_steps * r))


def _expanded_levels(scheme: Scheme, anchor_only: bool) -> torch.Tensor:
    """``û`` of every code (or anchor) value, fp32 ``[256]``: a companded scheme decodes through this table."""
    q = torch.arange(256, dtype=torch.float32)
    v = q if anchor_only else (q + 0.5) / float(scheme.residual_levels) - 0.5
    return expand(v * (2.0 / float(scheme.anchor_steps)) - 1.0, scheme)


def _decode_pass(code_of, offset, scale, shape, scheme: Scheme, anchor_only: bool, out: torch.Tensor) -> torch.Tensor:
    """Write ``B + K·code`` (linear) or ``o + s·levels[code]`` (companded) block by block into ``out``;
    ``code_of(t0, t1, ws)`` gives ``[H, t1-t0, D]`` uint8."""
    h, t, d = shape
    c = scheme.chunk
    levels = None
    if scheme.compander == "linear":
        base, k = _affine(offset, scale, scheme, anchor_only)  # [H, nc, 1, D]
    else:
        levels = _expanded_levels(scheme, anchor_only)
        base, k = offset.float().unsqueeze(2), scale.float().unsqueeze(2)
    nc = -(-t // c)
    nfull = t // c
    step = _step(nc, h * c * d)

    def job(c0: int, c1: int, cb: int) -> None:
        ws = _workspace(step * h * c * d)
        n = c1 - c0
        t0, t1 = c0 * c, c0 * c + n * cb
        q = code_of(t0, t1, ws).view(h, n, cb, d)
        f = ws.xf[: q.numel()].view(h, n, cb, d)
        if levels is None:
            f.copy_(q)
        else:
            torch.index_select(levels, 0, q.reshape(-1).long(), out=f.view(-1))
        f.mul_(k[:, c0:c1]).add_(base[:, c0:c1])
        out[:, t0:t1].copy_(f.view(h, n * cb, d))

    spans = [(c0, min(nfull, c0 + step), c) for c0 in range(0, nfull, step)]
    if nfull < nc:
        spans.append((nfull, nc, t - nfull * c))
    _run(job, spans)
    return out


def _check_out(out: torch.Tensor | None, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape):
        raise InputError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


@_single_thread
def dequantize_fast(
    enc: EncodedTensor,
    scheme: Scheme,
    *,
    anchor_only: bool = False,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`lynxkv.quant.dequantize` (within the tested tolerance), optionally into a preallocated ``out``."""
    shape = enc.shape
    if not supports(scheme) or shape[1] == 0:
        res = dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype)
        if out is None:
            return res
        return _check_out(out, shape, dtype).copy_(res)
    out = _check_out(out, shape, dtype)
    rb = scheme.residual_bits

    def code_of(t0: int, t1: int, ws: _Workspace) -> torch.Tensor:
        a = enc.anchor[:, t0:t1]
        if anchor_only:
            return a
        codes = ws.codes[: a.numel()].view(a.shape)
        torch.bitwise_left_shift(a, rb, out=codes)
        return codes.bitwise_or_(enc.residual[:, t0:t1])

    return _decode_pass(code_of, enc.offset, enc.scale, shape, scheme, anchor_only, out)


@_single_thread
def decode_packed_fast(
    anchor_packed: torch.Tensor,
    residual_packed: torch.Tensor | None,
    offset: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int, int],
    scheme: Scheme,
    *,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack and dequantize ``[H, T, D]`` from packed anchor (+ residual, or ``None`` for anchor only)."""
    h, t, d = shape
    anchor_only = residual_packed is None
    if not (supports(scheme) and scheme.anchor_bits == 4 and d % 2 == 0) or t == 0:
        n = h * t * d
        a = unpack_bits(anchor_packed, scheme.anchor_bits, n).view(shape)
        r = torch.zeros_like(a) if anchor_only else unpack_bits(residual_packed, scheme.residual_bits, n).view(shape)
        enc = EncodedTensor(a, r, offset, scale)
        return dequantize_fast(enc, scheme, anchor_only=anchor_only, dtype=dtype, out=out)
    out = _check_out(out, shape, dtype)
    need = packed_size(h * t * d, 4)
    for name, buf in (("anchor", anchor_packed), ("residual", residual_packed)):
        if buf is not None and buf.numel() != need:
            raise InputError(f"{name} payload: expected {need} bytes for shape {tuple(shape)}, got {buf.numel()}")
    ap = anchor_packed.reshape(h, t, d // 2)
    rp = None if anchor_only else residual_packed.reshape(h, t, d // 2)

    def code_of(t0: int, t1: int, ws: _Workspace) -> torch.Tensor:
        m = h * (t1 - t0) * (d // 2)
        shp = (h, t1 - t0, d // 2)
        a, word, tmp = (b[:m].view(shp) for b in (ws.w1, ws.w2, ws.w3))
        a.copy_(ap[:, t0:t1])
        if anchor_only:  # the two anchor nibbles become bytes 0 and 1 of the word
            torch.bitwise_and(a, 0x0F, out=word)
            word.bitwise_or_(a.bitwise_and_(0xF0).bitwise_left_shift_(4))
            return word.view(torch.uint8)
        # byte 0 = (a_lo << 4) | r_lo, byte 1 = (a_hi << 4) | r_hi, as one little-endian int16 word
        tmp.copy_(rp[:, t0:t1])
        torch.bitwise_and(tmp, 0x0F, out=word)
        word.bitwise_or_(tmp.bitwise_and_(0xF0).bitwise_left_shift_(4))
        torch.bitwise_and(a, 0x0F, out=tmp)
        word.bitwise_or_(tmp.bitwise_left_shift_(4))
        word.bitwise_or_(a.bitwise_and_(0xF0).bitwise_left_shift_(8))
        return word.view(torch.uint8)

    return _decode_pass(code_of, offset, scale, shape, scheme, anchor_only, out)


def _check_shape(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise InputError(f"expected a [kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"expected a floating-point tensor, got {x.dtype}")


# ----------------------------------------------------------------------------------------------- dispatch
def best_quantize(scheme: Scheme, device: str | torch.device | None = None) -> QuantizeFn:
    """The fastest bit-exact ``quantize(x, scheme) -> EncodedTensor`` for ``scheme`` on ``device``.

    ``device`` defaults to CUDA when available, else CPU. On CUDA, when Triton imports and the kernel supports
    the scheme: the fused Triton encode for CUDA tensors (CPU tensors still take the fast CPU path); on CPU:
    :func:`quantize_fast` for nested-grid schemes; anything else: the reference. Every choice returns the
    same bits as :func:`lynxkv.quant.quantize`.
    """
    if not supports(scheme):
        return quantize
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return quantize_fast
    try:
        from lynxkv.kernels import encode as kencode
    except ImportError:  # Triton is optional
        return quantize_fast
    if not kencode.supports(scheme):
        return quantize_fast

    def quantize_best(x: torch.Tensor, scheme: Scheme) -> EncodedTensor:
        return kencode.quantize_triton(x, scheme) if x.is_cuda else quantize_fast(x, scheme)

    return quantize_best


__all__ = [
    "best_quantize",
    "chunk_meta",
    "decode_packed_fast",
    "dequantize_fast",
    "encode_packed_fast",
    "pack",
    "quantize_fast",
    "supports",
    "unpack",
]
