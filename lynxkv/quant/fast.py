"""The fast CPU path: compiled C kernels (``lynxkv/quant/_native.c``, called through ctypes), bit-identical to
:mod:`lynxkv.quant.reference` in codes, metadata and decoded values, for every scheme. This module builds the
tables the kernels read, checks and lays out the tensors, and splits the work over threads.

Why it is exact:

- **Codes from a threshold table.** The code of an element depends only on its normalised value
  ``u = fl(fl(x - o) / s)`` in ``[-1, 1]``, through a monotone step function (compander, then rounding). Read as
  an integer, ``key = bits(u) ^ ((bits(u) >> 31) & 0x7FFFFFFF)`` orders the fp32 values of ``[-1, 1]``, so the
  function is fixed by the (at most 255) keys where the code steps up. :func:`code_table` finds each of them by
  bisection over the keys, evaluating the reference's own :func:`~lynxkv.quant.reference.codes_of_u`, and
  stores per bucket of ``2^S`` consecutive keys, in one 32-bit entry, the code at the bucket's start, the low
  bits of the one step inside it and the code from there on: ``code = key mod 2^S >= low[b] ? top[b] : base[b]``
  with ``b = key >> S``. The steps of any scheme are more than ``2^16`` keys apart (the code steps at most once
  per ``1/127.5`` of ``z``, and the compander's slope is bounded), so ``S = 16`` always fits and the table has
  32K entries (128 KiB, in L2). The AVX2 encode looks every code up there (the exact ``u`` by a division, one
  gather per 8 elements): no compander is evaluated per element, and the α-law default costs what the linear
  scheme costs. The portable loops take a first pass through an fp32 compander and look up only the elements
  near a step (:func:`_approximation`).
  ``benchmarks/check_code_identity.py`` compares the table with the reference over every fp32 ``u`` in
  ``[-1, 1]``; the tests check the neighbourhood of every threshold.
- **Metadata from the group's range.** Rounding is monotone and symmetric, so
  ``max_i |fl(x_i - o)| = max(fl(max - o), fl(o - min))``: the pass that reads a unit finds each group's max and
  min (a group: C tokens of one channel, or for values per channel C channels of one token, read in place), the
  reference's rounding of offset and scale runs on those. The max and min are taken over integer order keys
  (they vectorise); a group of zeros keeps its first zero's sign, as the reference's running max and min do.
  (``mean`` centring takes the reference's pinned tree sum.)
- **Decoding through a level table.** The reference decodes ``x̂ = o + s·û(code)``; ``û`` of all 256 codes (or
  of every anchor) is computed once by the reference itself, so ``fl(o + fl(s·levels[code]))`` is the
  reference's value bit for bit, rounded to bf16 (nearest even) or kept in fp32 in the same loop.
- **Rotated keys** (format 1.3): the Walsh–Hadamard butterfly of :mod:`lynxkv.quant.rotation`, the same fp32
  additions on the same operands (so the same bits), runs per row in the encode pass (before the range), in the
  decode pass (after ``o + s·û``, before the cast) and in :func:`rotate`.
- **Vectors.** Where the CPU has AVX2 (checked at run time) the rows of the default layout run on 8-lane vectors:
  lanes do the IEEE operations a scalar loop does, and the kernels are compiled without fused multiply-add, so
  the bits do not depend on the path; the tests run both against the reference.

The loops release the GIL and run on a small thread pool (``LYNXKV_CPU_THREADS``, default the torch intra-op
thread count, at most 8), each worker on a contiguous span of units ((head, chunk), or (head, token) for values
per channel). Inputs and outputs may be strided views whose last axis is contiguous (a slice of a larger cache is
written in place). The kernels are built by ``pip install`` (a C compiler is needed); where they were not built,
or with ``LYNXKV_NATIVE=0``, :func:`available` is false and the entry (:mod:`lynxkv.quant.dispatch`) uses the
reference.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from lynxkv.errors import InputError
from lynxkv.native import load_extension
from lynxkv.quant import reference, rotation
from lynxkv.quant.reference import META_TORCH_DTYPE, EncodedTensor
from lynxkv.quant.scheme import Scheme

#: Keys of u = -1.0 and u = +1.0 (see the module docstring).
KEY_MIN = -1065353217
KEY_MAX = 1065353216
#: log2 of the keys per table bucket.
TABLE_SHIFT = 16
#: ``log(1 + f) ≈ f - f²/2 + f³·P(f)`` on ``f`` in [√½ - 1, √2 - 1] (a degree-5 Chebyshev fit): within 8e-7 of
#: the log, plus fp32 rounding; the kernels' margin assumes 2^-19·max(1, log y).
LOG_POLY = (0.33333557528147356, -0.24994054257805176, 0.19955300260002215, -0.1694757798896947,
            0.15702601920540465, -0.10606678495069904)
LOG_ERROR = 2.0**-19


def available() -> bool:
    """Whether the compiled kernels are here (built by ``pip install`` with a C compiler, not disabled by
    ``LYNXKV_NATIVE=0``); without them the quantizer entry uses the torch reference."""
    return _NATIVE is not None


# ----------------------------------------------------------------------------------------------- tables
def _u_of_key(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of int64 keys in ``[KEY_MIN, KEY_MAX]``."""
    bits = torch.where(keys >= 0, keys, keys ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32)


def _code_of_key(keys: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    a, r = reference.codes_of_u(_u_of_key(keys.clamp(KEY_MIN, KEY_MAX)), scheme)
    return reference.join_code(a, r, scheme).to(torch.int64)


def code_steps(scheme: Scheme) -> torch.Tensor:
    """The keys (int64, ascending) where the reference's 8-bit code steps up, by bisection over ``[KEY_MIN,
    KEY_MAX]``: the code of a key is that of the last step at or below it (or of ``KEY_MIN``)."""
    targets = torch.arange(1, 256, dtype=torch.int64)
    lo = torch.full_like(targets, KEY_MIN - 1)  # code(lo) < target (conceptually; lo is below the range)
    hi = torch.full_like(targets, KEY_MAX + 1)  # code(hi) >= target
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        up = _code_of_key(mid, scheme) >= targets
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid)
    return torch.unique(hi[(hi > KEY_MIN) & (hi <= KEY_MAX)])


@functools.lru_cache(maxsize=32)
def code_table(scheme: Scheme) -> tuple[np.ndarray, int]:
    """``(table uint32 [n], offset)``: bucket ``b = (key >> TABLE_SHIFT) + offset`` holds the low 16 bits of the
    one code step inside it (0 where there is none), the code below that step (bits 16-23) and the code from it
    on (bits 24-31): a key's code is the second where its low 16 bits reach the first, else the first (the
    reference's 8-bit code). One 32-bit load per element."""
    steps = code_steps(scheme)
    buckets = steps >> TABLE_SHIFT
    if buckets.numel() != torch.unique(buckets).numel():  # impossible for the schemes Scheme accepts
        raise InputError(f"scheme {scheme.describe()}: two code steps closer than 2^{TABLE_SHIFT} fp32 values")
    b_min, b_max = KEY_MIN >> TABLE_SHIFT, KEY_MAX >> TABLE_SHIFT
    starts = (torch.arange(b_min, b_max + 1, dtype=torch.int64) << TABLE_SHIFT).clamp(min=KEY_MIN)
    step = starts.clone()  # where a bucket has no step inside, its start (the low bits are not looked at)
    has = torch.zeros(starts.shape, dtype=torch.bool)
    inside = steps > starts[buckets - b_min]  # a step exactly at a bucket's start is its base code
    step[buckets[inside] - b_min] = steps[inside]
    has[buckets[inside] - b_min] = True
    base = _code_of_key(starts, scheme)
    top = torch.where(has, _code_of_key(step, scheme), base)
    low = torch.where(has, step & 0xFFFF, 0)  # no step: base == top, either way
    table = (low | (base << 16) | (top << 24)).to(torch.int64).numpy().astype(np.uint32)
    return table, -b_min


@functools.lru_cache(maxsize=64)
def level_table(scheme: Scheme, anchor_only: bool) -> np.ndarray:
    """fp32 ``û`` of every code (``[256]``) or of every anchor value (``[2^anchor_bits]``), by the reference."""
    if anchor_only:
        return reference.expanded_levels(torch.arange(1 << scheme.anchor_bits, dtype=torch.uint8), None, scheme).numpy()
    a, r = reference.split_code(torch.arange(256, dtype=torch.int32).to(torch.uint8), scheme)
    return reference.expanded_levels(a, r, scheme).numpy()


# ----------------------------------------------------------------------------------------------- kernels (C)
def _native_library():
    """The compiled kernels (``lynxkv/quant/_native.c``) through ctypes, or None where they were not built or
    ``LYNXKV_NATIVE=0``: then :func:`available` is false and the entry uses the reference."""
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
    return load_extension("lynxkv.quant._native", {
        "lynx_decode_pages": ([p, p, p, p, p, i64, i32, i32, i32, i32, i32, i64, f32, i64, i64, i64, i64, p, p, i32,
                               i64, i64, i64], i64),
        "lynx_encode_units": ([p, i32, i64, i64, i64, i64, i64, i64, i64, i32, i64, f32, i64, i64, i32, p, p, i32,
                               f32, f32, f32, f32, f32, p, p, i64, i32, i32, i32, p, p, i64, i64], i64),
        "lynx_rotate_rows": ([p, i32, i64, i64, i64, i64, i64, i64, f32, p, i64, i64], i64),
        "lynx_pack4_rows": ([p, i64, i64, i64, i64, i64, p, i64, i64], i64),
        "lynx_unpack4": ([p, p, i64, i64], i64),
        "lynx_vector_rows": ([], i32),
        "lynx_scalar_only": ([i32], None),
    })


_NATIVE = _native_library()
_LOG_POLY_F32 = np.array(LOG_POLY, dtype=np.float32)


def native() -> str | None:
    """Which compiled kernels run: ``"avx2"`` (the vector rows), ``"scalar"`` (the C loops without them), or None
    (not built: the entry uses the reference)."""
    if _NATIVE is None:
        return None
    return "avx2" if _NATIVE.lynx_vector_rows() else "scalar"


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _encode_kernel(x, x0, sh, st, T, D, C, nc, per_row, block, rotation_scale, u0, u1, meta_given, offset, scale,
                   alpha, inv_c, gk, gb, margin, table, off, shift, rb, packed, a_out, r_out, out_h, out_t):
    """Metadata and codes of units ``[u0, u1)`` (``lynx_encode_units``, whose comment documents the arguments);
    returns problem flags: 1 = the input is not finite, 2 = a centre overflows the metadata dtype, 4 = a scale
    does.

    Groups along tokens (keys): a unit is one (head, chunk of C tokens), the groups its D channels, metadata
    ``[H·nc·D]``. ``per_row`` (values per channel, format 1.2): a unit is one (head, token) row, the groups its
    runs of C channels, metadata ``[H·T·ceil(D/C)]``. ``offset``/``scale`` (fp32, or fp16 as uint16 bits) are
    written from each group's max and min (midrange centring), or read (``meta_given``: the reference computed
    them). Codes go out packed 4+4 (``packed``; pairs along D, ``[H·T·D/2]`` bytes each) or as anchor and residual
    bytes, element ``(h, t, d)`` at ``h·out_h + t·out_t + d``. ``block`` > 1 (keys of format 1.3, along tokens):
    each row is rotated first (the butterfly within blocks of ``block`` channels, then times ``rotation_scale``)."""
    flags = _NATIVE.lynx_encode_units(
        _ptr(x), int(x.dtype == np.uint16), x0, sh, st, T, D, C, nc, per_row, block, rotation_scale, u0, u1,
        meta_given, _ptr(offset), _ptr(scale), int(offset.dtype == np.uint16), alpha, inv_c, gk, gb, margin,
        _ptr(_LOG_POLY_F32), _ptr(table), off, shift, rb, packed, _ptr(a_out), _ptr(r_out), out_h, out_t)
    if flags < 0:
        raise MemoryError("the encode's unit buffers could not be allocated")
    return flags


def _decode_kernel(o_buf: int, s_buf: int, a_buf: int, r_buf: int, pages: np.ndarray, packed, anchor_only, rb, wide,
                   per_row, block, back, H, C, u0, u1, levels: np.ndarray, y: int, y_bf16: bool, sh, st, sd):
    """``x̂ = o + s·levels[code]`` for units ``[u0, u1)`` into ``y`` (the address of fp32, or of bf16 as uint16
    bits: ``y_bf16``) by ``lynx_decode_pages``; ``o_buf``/``s_buf``/``a_buf``/``r_buf`` are the addresses of the
    byte buffers; returns metadata problem flags: 1 = an offset is not finite, 2 = a scale is not finite, 4 = a
    scale is negative.

    ``pages`` int64 ``[P, 10]``, one row per page of ``rows x cols`` elements per head: byte offsets of its
    offsets and scales (``[H, ceil(held/C), cols]``, little-endian fp16, or fp32 when ``wide``) in
    ``o_buf``/``s_buf`` and of its codes (``[H, held, cols]`` and ``[H, residual held, cols]`` row-major) in
    ``a_buf``/``r_buf``, the element offset in ``y`` of its first element, ``rows``, ``cols``, ``held`` and
    ``residual held`` (the rows per head its arrays hold, of which the first ``rows`` are decoded) and its first
    unit (a unit is one (head, chunk) of one page; units are numbered page after page). Codes are packed 4+4 (``packed``: two per byte, the first in the low nibble; ``cols`` even)
    or one byte each; ``anchor_only`` indexes ``levels`` by the anchor. Element (h, t, d) of a page goes to
    ``y[y0 + h·sh + t·st + d·sd]``: any strided view. ``per_row``: the groups run along each row instead (values
    per channel), metadata ``[H, rows, ceil(cols/C)]``, a unit one (head, row). ``block`` > 1: the codes are of
    Hadamard-rotated rows (keys, format 1.3), each decoded fp32 row rotated back (the butterfly, then times
    ``back``) before it is stored."""
    flags = _NATIVE.lynx_decode_pages(
        o_buf, s_buf, a_buf, r_buf, _ptr(pages), pages.shape[0], packed, anchor_only, rb, wide, per_row, block,
        back, H, C, u0, u1, _ptr(levels), y, int(y_bf16), sh, st, sd)
    if flags < 0:
        raise MemoryError("the decode's row buffer could not be allocated")
    return flags


def _rotate_kernel(x, x0, sh, st, T, D, block, scale, y, r0, r1):
    return _NATIVE.lynx_rotate_rows(_ptr(x), int(x.dtype == np.uint16), x0, sh, st, T, D, block, scale, _ptr(y), r0,
                                    r1)


def _pack4_rows_kernel(v, v0, sh, st, n, D, out, r0, r1):
    return _NATIVE.lynx_pack4_rows(_ptr(v), v0, sh, st, n, D, _ptr(out), r0, r1)


def _unpack4_kernel(p, out, i0, i1):
    return _NATIVE.lynx_unpack4(_ptr(p), _ptr(out), i0, i1)


# ----------------------------------------------------------------------------------------------- threads
_POOL: ThreadPoolExecutor | None = None


def workers() -> int:
    """Worker threads: ``LYNXKV_CPU_THREADS``, else the torch intra-op thread count, at most 8."""
    env = os.environ.get("LYNXKV_CPU_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(8, torch.get_num_threads()))


def _parallel(kernel, units: int, args_before: tuple, args_after: tuple, min_units: int = 1,
              threads: int | None = None) -> list:
    """``kernel(*args_before, u0, u1, *args_after)`` over ``[0, units)`` split into contiguous spans, one per
    worker (``threads``, default :func:`workers`; the kernels release the GIL); the kernels' results."""
    global _POOL
    n = max(1, min(threads or workers(), units // max(1, min_units)))
    if n == 1:
        return [kernel(*args_before, 0, units, *args_after)]
    if _POOL is None or _POOL._max_workers < n:  # noqa: SLF001 - grow when the setting changes
        _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="lynxkv-quant")
    bounds = [units * i // n for i in range(n + 1)]
    futures = [_POOL.submit(kernel, *args_before, bounds[i], bounds[i + 1], *args_after) for i in range(n)]
    return [f.result() for f in futures]


# ----------------------------------------------------------------------------------------------- tensors
def _flat(t: torch.Tensor) -> tuple[np.ndarray, int, int, int, int]:
    """A 1-d numpy view over the storage span of ``t`` ``[H, T, D]`` (any non-negative strides) and the element
    strides: ``(buffer, start, stride_h, stride_t, stride_d)``; bf16 is viewed as uint16 bits."""
    h, n, d = t.shape
    if t.is_contiguous():
        flat = t.view(-1)
    else:
        span = 1 + (h - 1) * t.stride(0) + (n - 1) * t.stride(1) + (d - 1) * t.stride(2)
        flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
    arr = flat.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else flat.numpy()
    return arr, 0, t.stride(0), t.stride(1), t.stride(2)


def _input(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
        raise InputError(f"expected a [kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"expected a floating-point tensor, got {x.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _meta_np(t: torch.Tensor) -> np.ndarray:
    """A metadata tensor as the kernels take it: fp32, or fp16 as uint16 bits, flat."""
    flat = t.contiguous().view(-1)
    return flat.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.float16 else flat.numpy()


def _codes(x: torch.Tensor, scheme: Scheme, packed: bool, meta: tuple[torch.Tensor, torch.Tensor] | None = None,
           axis: str = "token", rotated: bool = False, threads: int | None = None):
    """``(anchor, residual, offset, scale)`` with flat code buffers in ``[H, T, D]`` order; groups along
    ``axis`` (``"token"``: metadata ``[H, ceil(T/C), D]``; ``"channel"``: ``[H, T, ceil(D/C)]``); ``meta``
    given: those offsets and scales; ``rotated``: of the Hadamard-rotated rows (rotated inside the pass along
    tokens; by :func:`lynxkv.quant.rotation.rotate` first otherwise, where the metadata is the reference's)."""
    x = _input(x)
    h, t, d = x.shape
    source = x
    if rotated and (axis == "channel" or meta is not None or scheme.centring == "mean"):
        x, rotated = rotate(x), False  # the metadata is the reference's: the rotation in a pass of its own
    c = scheme.chunk
    nc = -(-t // c)
    per_row = axis == "channel"
    meta_shape = (h, t, -(-d // c)) if per_row else (h, nc, d)
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    meta_given = meta is not None or scheme.centring == "mean"
    if meta is not None:
        offset, scale = meta
    elif meta_given:  # the pinned tree sum of the mean: the reference's
        if not bool(torch.isfinite(x).all()):
            raise InputError("tensor holds inf or NaN values; only finite KV caches can be quantized")
        if per_row:
            offset, scale = (m.transpose(1, 2).contiguous()
                             for m in reference.chunk_meta(x.transpose(1, 2).contiguous(), scheme))
        else:
            offset, scale = reference.chunk_meta(x, scheme)
    else:
        offset = torch.empty(meta_shape, dtype=meta_dtype)
        scale = torch.empty(meta_shape, dtype=meta_dtype)
    table, off = code_table(scheme)
    alpha, inv_c, gk, gb, margin = _approximation(scheme)
    n = h * t * d
    size = n // 2 if packed else n
    a_out = torch.empty(size, dtype=torch.uint8)
    r_out = torch.empty(size, dtype=torch.uint8)
    buf, x0, sh, st, _ = _flat(x)  # _input: the last axis is contiguous
    flags = 0
    block, k = (rotation.block_size(d), rotation.shifts(d)[0]) if rotated else (1, 0)  # encode: times 2^-k
    for f in _parallel(
        _encode_kernel, h * t if per_row else h * nc,
        (buf, x0, sh, st, t, d, c, nc, per_row, block, np.float32(2.0**-k)),
        (meta_given, _meta_np(offset), _meta_np(scale), alpha, inv_c, gk, gb, margin, table, off, TABLE_SHIFT,
         scheme.residual_bits, packed, a_out.numpy(), r_out.numpy(), t * d, d), threads=threads,
    ):
        flags |= f
    if flags & 1:
        if block > 1 and bool(torch.isfinite(source).all()):
            raise rotation.overflow_error()
        raise InputError("tensor holds inf or NaN values; only finite KV caches can be quantized")
    if flags & 2:
        raise InputError(f"chunk centre overflows the {scheme.meta_dtype} metadata; values are too large")
    if flags & 4:
        raise InputError(f"chunk range overflows the {scheme.meta_dtype} metadata; values are too large")
    return a_out, r_out, offset, scale


@functools.lru_cache(maxsize=32)
def _approximation(scheme: Scheme) -> tuple[np.float32, np.float32, np.float32, np.float32, np.float32]:
    """``(α, 1/c, gk, gb, margin)`` of the kernels' first pass, fp32: ``g = (z + 1)·gk + gb`` puts the code
    boundaries at the integers (nested grid: ``gk = A·R/2``, ``gb = R/2``; uniform: ``Q/2``, ``1/2``).

    ``margin`` bounds how far that approximate ``g`` can be from the one the reference's ``z`` gives, times
    two: ``u`` by a reciprocal (2^-22 relative), ``α``, ``α|u|`` and ``1 + α|u|`` (2^-24 each), the log
    (:data:`LOG_ERROR`·max(1, c) absolute), the product by 1/c (2^-23), the reference's own rounding of z (2^-24), and
    2^-13 for the few fp32 roundings on the way to ``g`` in both (together about 2^-14). A margin past 1/4 (α so small
    that log(1 + α|u|) is mostly rounding) leaves every element to the exact pass.
    """
    if scheme.grid == "uniform":
        gk, gb = scheme.code_steps / 2.0, 0.5
    else:
        gk, gb = scheme.anchor_steps * scheme.residual_levels / 2.0, scheme.residual_levels / 2.0
    if scheme.compander == "linear":
        alpha, inv_c, eps_z = 0.0, 0.0, 2.0**-22 + 2.0**-24
    else:
        alpha = scheme.alpha
        c = float(np.float32(np.log1p(alpha)))
        inv_c = 1.0 / c
        eps_z = (1.75 * 2.0**-22 + LOG_ERROR * max(1.0, c)) / c + 2.0**-23 + 2.0**-24
    margin = 2.0 * (gk * eps_z + 2.0**-13)
    if margin > 0.25:
        margin = 2.0  # every |g - rint(g)| <= 1/2 is below it: the exact pass takes all
    f = np.float32
    return f(alpha), f(inv_c), f(gk), f(gb), f(margin)


def codes_of_u(u: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lynxkv.quant.reference.codes_of_u` through the encode kernel (offset 0, scale 1, so the kernel's
    ``u`` is the input itself): for the exhaustive identity check and the tests. ``u``: fp32 ``[n]`` in
    ``[-1, 1]``."""
    n = u.numel()
    x = torch.cat([u.reshape(-1), u.new_zeros(-n % 64)]).view(1, -1, 64)
    nc = -(-x.shape[1] // scheme.chunk)
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    meta = (torch.zeros((1, nc, 64), dtype=meta_dtype), torch.ones((1, nc, 64), dtype=meta_dtype))
    a, r, _, _ = _codes(x, scheme, packed=False, meta=meta)
    return a[:n], r[:n]


def packable(scheme: Scheme, head_dim: int) -> bool:
    """Whether the fused packed layout applies: the 4+4 split and an even head_dim (byte pairs along D)."""
    return scheme.anchor_bits == 4 and head_dim % 2 == 0


def quantize(x: torch.Tensor, scheme: Scheme, axis: str = "token", rotated: bool = False) -> EncodedTensor:
    """:func:`lynxkv.quant.reference.quantize_tokens` (``axis="token"``) or the reference's encoding of values per
    channel (``axis="channel"``: groups of C channels of one token, read in place, no transposed copy), of the
    Hadamard-rotated rows where ``rotated`` (keys of format 1.3: rotated inside the same pass), bit for bit (CPU
    tensors; no sink tokens or rotation marked: :func:`lynxkv.quant.reference.quantize`, whose ``encoder`` this
    is, does that)."""
    h, t, d = _input(x).shape
    if rotated and (t == 0 or d == 0 or h == 0):
        x = rotate(x)
    if t == 0 or d == 0 or h == 0:
        if axis == "channel":
            enc = reference.quantize_tokens(x.transpose(1, 2), scheme)
            return EncodedTensor(*(m.transpose(1, 2).contiguous() for m in (enc.anchor, enc.residual, enc.offset,
                                                                             enc.scale)), axis="channel")
        return reference.quantize_tokens(x, scheme)
    a, r, offset, scale = _codes(x, scheme, packed=False, axis=axis, rotated=rotated)
    return EncodedTensor(a.view(h, t, d), r.view(h, t, d), offset, scale, axis)


def quantize_packed(x: torch.Tensor, scheme: Scheme, *, axis: str = "token", rotated: bool = False,
                    threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(anchor_bytes, residual_bytes, offset, scale)``: the packed codes equal ``pack_bits`` of the reference's
    anchor and residual over the ``[H, T, D]`` flattening (needs :func:`packable`), groups along ``axis``, the
    rows rotated where ``rotated``; on up to ``threads`` worker threads (default :func:`workers`)."""
    h, t, d = _input(x).shape
    if not packable(scheme, d):
        raise InputError(f"the packed layout needs the 4+4 split and an even head_dim, got "
                         f"{scheme.anchor_bits}+{scheme.residual_bits} and head_dim {d}")
    if t == 0 or h == 0:
        enc = quantize(x, scheme, axis, rotated)
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), enc.offset, enc.scale
    return _codes(x, scheme, packed=True, axis=axis, rotated=rotated, threads=threads)


def _out(out: torch.Tensor | None, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.device.type != "cpu":
        raise InputError(f"out: expected a CPU tensor of shape {tuple(shape)}, got {tuple(out.shape)} on {out.device}")
    return out


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor in C order (a view where it is contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _decode_pages(o_buf, s_buf, a_buf, r_buf, pages: list[tuple[int, ...]], packed: bool, scheme: Scheme,
                  out: torch.Tensor, threads: int | None, per_row: bool = False, rotated: bool = False) -> int:
    """Run :func:`_decode_kernel` over ``pages`` (rows of its table without the last column, the first unit,
    which is added here, and without the rows held by the arrays where they are the rows decoded; element offsets
    relative to ``out``'s first element) into ``out`` (any CPU tensor with
    non-negative strides; fp32 and bf16 are written in place, other dtypes through an fp32 tensor of the same
    strides); returns the metadata problem flags. ``rotated``: rows of Hadamard-rotated keys, rotated back in the
    same pass. Python work per call is kept small: the progressive reader calls this once per page."""
    anchor_only = r_buf is None
    direct = out.dtype in (torch.float32, torch.bfloat16)
    y = out if direct else torch.empty_strided(out.shape, out.stride(), dtype=torch.float32)
    c = scheme.chunk
    h = out.shape[0]
    block, back = (rotation.block_size(out.shape[2]), rotation.shifts(out.shape[2])[1]) if rotated else (1, 0)
    table, units = [], 0
    for row in pages:  # (o, s, a, r, y0, rows, cols[, held, residual held])
        table.append((*row, units) if len(row) == 9 else (*row, row[5], row[5], units))
        units += h * (row[5] if per_row else -(-row[5] // c))
    sh, st, sd = y.stride()  # the kernel writes y[h·sh + t·st + d·sd] from y's first element
    a_at = _ptr(a_buf)  # the buffers' addresses, each taken once (the records hold metadata and codes alike)
    o_at, s_at = (a_at if b is a_buf else _ptr(b) for b in (o_buf, s_buf))
    r_at = a_at if anchor_only else _ptr(r_buf)
    flags = 0
    for f in _parallel(
        _decode_kernel, units,
        (o_at, s_at, a_at, r_at, np.array(table, dtype=np.int64), packed, anchor_only, scheme.residual_bits,
         scheme.meta_dtype == "fp32", per_row, block, np.float32(2.0**-back), h, c),
        (level_table(scheme, anchor_only), y.data_ptr(), y.dtype == torch.bfloat16, sh, st, sd), threads=threads,
        min_units=max(1, (1 << 16) // ((1 if per_row else c) * out.shape[2] or 1)),  # a thread per 64K elements
    ):
        flags |= f
    if y is not out:
        out.copy_(y)
    return flags


def _decode(a, r, packed: bool, offset, scale, shape, scheme: Scheme, dtype, out, threads, rotated: bool):
    h, t, d = shape
    out = _out(out, shape, dtype)
    if out.numel() == 0:
        return out
    nc = -(-t // scheme.chunk)
    if tuple(offset.shape) != (h, nc, d) or tuple(scale.shape) != (h, nc, d):
        raise InputError(f"offset/scale: expected shape {(h, nc, d)}, got {tuple(offset.shape)}/{tuple(scale.shape)}")
    pages = [(0, 0, 0, 0, 0, t, d)]  # the whole tensor as one page
    _decode_pages(_bytes(offset), _bytes(scale), _bytes(a), None if r is None else _bytes(r), pages, packed, scheme,
                  out, threads, rotated=rotated)
    return out


def dequantize(enc: EncodedTensor, scheme: Scheme, *, anchor_only: bool = False, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """:func:`lynxkv.quant.reference.dequantize` of groups along tokens, bit for bit (rotated keys rotated back
    in the same pass), optionally into a preallocated ``out`` (any CPU float tensor of the shape with a contiguous
    last axis is written in place; other layouts are copied). The sink tokens are the caller's: every token
    decodes from the codes given."""
    shape = tuple(enc.anchor.shape)
    n = enc.anchor.numel()
    if not anchor_only and (enc.residual is None or enc.residual.numel() != n):
        raise InputError(f"residual: expected {n} codes, got {0 if enc.residual is None else enc.residual.numel()}")
    return _decode(enc.anchor, None if anchor_only else enc.residual, False, enc.offset, enc.scale, shape, scheme,
                   dtype, out, threads, enc.rotated)


def dequantize_packed(anchor: torch.Tensor, residual: torch.Tensor | None, offset: torch.Tensor, scale: torch.Tensor,
                      shape: tuple[int, int, int], scheme: Scheme, *, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None, threads: int | None = None,
                      rotated: bool = False) -> torch.Tensor:
    """Unpack and dequantize packed 4+4 bytes (``residual`` None: from the anchor alone) into ``[H, T, D]``
    (``rotated``: of Hadamard-rotated keys, rotated back)."""
    h, t, d = shape
    if not packable(scheme, d):
        raise InputError(f"the packed layout needs the 4+4 split and an even head_dim, got "
                         f"{scheme.anchor_bits}+{scheme.residual_bits} and head_dim {d}")
    need = h * t * d // 2
    for name, buf in (("anchor", anchor), ("residual", residual)):
        if buf is not None and buf.numel() != need:
            raise InputError(f"{name} payload: expected {need} bytes for shape {tuple(shape)}, got {buf.numel()}")
    return _decode(anchor, residual, True, offset, scale, shape, scheme, dtype, out, threads, rotated)


def dequantize_pages(anchor, residual, pages, scheme: Scheme, *, out: torch.Tensor, threads: int | None = None,
                     axis: str = "token", rotated: bool = False) -> int:
    """Dequantize pages of packed 4+4 codes held in byte buffers straight into ``out`` ``[H, T, D]`` (a CPU
    tensor, any strides; needs :func:`packable`), without unpacking or concatenating anything first.

    ``pages``: one row of integers per page ``(offset_at, scale_at, anchor_at, residual_at, t0, n)``: the
    page holds tokens ``[t0, t0 + n)``; its offsets and scales (``[H, ceil(n/C), D]``, little-endian metadata
    dtype) start at bytes ``offset_at`` and ``scale_at`` of ``anchor``, its packed anchor codes (``[H, n, D]``
    flattened) at ``anchor_at``; its residual codes at ``residual_at`` of ``residual`` (``None``: the anchor
    alone). A row of eight, ``(..., t0, n, held, residual_held)``, decodes the first ``n`` tokens of each head of
    arrays that hold ``held`` tokens per head (metadata and anchor codes) and ``residual_held`` (residual codes):
    the sink tokens of a page, whose residual codes the anchor record holds apart. Returns metadata problem flags (1: an offset is not finite, 2: a scale is not finite, 4: a scale is
    negative); the values written for such a page are what the arithmetic gives. ``axis="channel"``: the groups
    run along the channels of each token (values per channel, format 1.2), metadata ``[H, n, ceil(D/C)]``.
    ``rotated``: the codes are of Hadamard-rotated keys (format 1.3), rotated back in the same pass."""
    h, t, d = out.shape
    if not packable(scheme, d):
        raise InputError(f"the packed layout needs the 4+4 split and an even head_dim, got "
                         f"{scheme.anchor_bits}+{scheme.residual_bits} and head_dim {d}")
    if out.device.type != "cpu" or min(out.stride()) < 0:
        raise InputError(f"out: expected a CPU tensor with non-negative strides, got {out.device}")
    a_buf = np.frombuffer(anchor, dtype=np.uint8)
    r_buf = None if residual is None else np.frombuffer(residual, dtype=np.uint8)
    a_size, r_size = a_buf.size, 0 if r_buf is None else r_buf.size
    c, mb, st = scheme.chunk, scheme.meta_bytes, out.stride(1)
    table = []
    for row in pages:
        o_at, s_at, a_at, r_at, t0, n = row[:6]
        held, r_held = row[6:] if len(row) == 8 else (n, n)
        meta = h * (held * -(-d // c) if axis == "channel" else -(-held // c) * d) * mb
        if (min(o_at, s_at, a_at, r_at, t0, n) < 0 or t0 + n > t or n > min(held, r_held)
                or max(o_at, s_at) + meta > a_size or a_at + h * held * d // 2 > a_size
                or (r_buf is not None and r_at + h * r_held * d // 2 > r_size)):
            raise InputError(f"pages: page {tuple(row)} lies outside its buffers or outside out")
        if n and h and d:
            table.append((o_at, s_at, a_at, r_at, t0 * st, n, d, held, r_held))
    if not table:
        return 0
    if rotated and axis == "channel":
        raise InputError("pages: rotated codes have their groups along tokens (keys), not per channel")
    return _decode_pages(a_buf, a_buf, a_buf, r_buf, table, True, scheme, out, threads, per_row=axis == "channel",
                         rotated=rotated)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """:func:`lynxkv.quant.rotation.rotate` of ``x`` ``[H, T, D]`` (a CPU float tensor), bit for bit, in one
    compiled pass over the rows: fp32 ``[H, T, D]``."""
    x = _input(x)
    h, t, d = x.shape
    y = torch.empty((h, t, d), dtype=torch.float32)
    if y.numel() == 0 or rotation.block_size(d) == 1:
        return y.copy_(x)
    k, _ = rotation.shifts(d)
    buf, x0, sh, st, _ = _flat(x)
    _parallel(_rotate_kernel, h * t, (buf, x0, sh, st, t, d, rotation.block_size(d), np.float32(2.0**-k),
                                      y.view(-1).numpy()), (), min_units=64)
    return y


def pack4(values: torch.Tensor) -> torch.Tensor:
    """4-bit packing of an even number of uint8 values (two per byte, the first in the low nibble) in C order;
    a ``[H, n, D]`` view with even ``D`` and a contiguous last axis (a page of a larger tensor) is read in
    place."""
    if values.dim() == 3 and values.shape[2] % 2 == 0 and values.stride(2) == 1 and values.numel():
        h, n, d = values.shape
        buf, x0, sh, st, _ = _flat(values)
        out = torch.empty(h * n * d // 2, dtype=torch.uint8)
        _parallel(_pack4_rows_kernel, h * n, (buf, x0, sh, st, n, d, out.numpy()), (), min_units=1 << 12)
        return out
    flat = values.contiguous().view(-1)
    out = torch.empty(flat.numel() // 2, dtype=torch.uint8)
    if out.numel():  # rows of one pair
        _parallel(_pack4_rows_kernel, out.numel(), (flat.numpy(), 0, 0, 2, out.numel(), 2, out.numpy()), (),
                  min_units=1 << 18)
    return out


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack4`."""
    flat = packed.contiguous().view(-1)
    out = torch.empty(flat.numel() * 2, dtype=torch.uint8)
    _parallel(_unpack4_kernel, flat.numel(), (flat.numpy(), out.numpy()), (), min_units=1 << 18)
    return out
