"""The fast CPU path: compiled C kernels (``lynxkv/quant/_native.c``, a cffi module typed by ``_native.h``),
bit-identical to :mod:`lynxkv.quant.reference` in codes, metadata and decoded values, for every scheme. This
module checks and lays out the tensors, calls the kernels and splits the work over threads; the tables the
kernels read, and why their codes are exactly the reference's, are :mod:`lynxkv.quant.tables`.

The loops release the GIL and run on a small thread pool (``LYNXKV_CPU_THREADS``, default the torch intra-op
thread count, at most 8), each worker on a contiguous span of units ((head, chunk), or (head, token) for values
per channel). Inputs and outputs may be strided views whose last axis is contiguous (a slice of a larger cache is
written in place). The kernels are built by ``pip install`` (a C compiler is needed); where they were not built,
or with ``LYNXKV_NATIVE=0``, :func:`available` is false and the entry (:mod:`lynxkv.quant.dispatch`) uses the
reference.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from lynxkv.errors import InputError
from lynxkv.quant import reference, rotation
from lynxkv.quant.reference import META_TORCH_DTYPE, EncodedTensor
from lynxkv.quant.scheme import Scheme
from lynxkv.quant.c_kernels import (NATIVE, byte_pointer, decode_kernel, encode_kernel, pack4_rows_kernel,
                                    rotate_kernel, unpack4_kernel)
from lynxkv.quant.c_kernels import native  # noqa: F401  (which kernels run: part of this module's interface)
from lynxkv.quant.tables import TABLE_SHIFT, approximation, code_table, level_table



def available() -> bool:
    """Whether the compiled kernels are here (built by ``pip install`` with a C compiler, not disabled by
    ``LYNXKV_NATIVE=0``); without them the quantizer entry uses the torch reference."""
    return NATIVE is not None



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
    alpha, inv_c, gk, gb, margin = approximation(scheme)
    n = h * t * d
    size = n // 2 if packed else n
    a_out = torch.empty(size, dtype=torch.uint8)
    r_out = torch.empty(size, dtype=torch.uint8)
    buf, x0, sh, st, _ = _flat(x)  # _input: the last axis is contiguous
    flags = 0
    block, k = (rotation.block_size(d), rotation.shifts(d)[0]) if rotated else (1, 0)  # encode: times 2^-k
    for f in _parallel(
        encode_kernel, h * t if per_row else h * nc,
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
    Hadamard-rotated rows where ``rotated`` (keys: rotated inside the same pass), bit for bit (CPU
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
    """Run :func:`decode_kernel` over ``pages`` (rows of its table without the last column, the first unit,
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
    a_at = byte_pointer(a_buf)  # each buffer's pointer made once (the records hold metadata and codes alike)
    o_at, s_at = (a_at if b is a_buf else byte_pointer(b) for b in (o_buf, s_buf))
    r_at = a_at if anchor_only else byte_pointer(r_buf)
    flags = 0
    for f in _parallel(
        decode_kernel, units,
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
    the sink tokens of a page, whose residual codes the anchor record holds apart. Returns metadata problem flags
    (1: an offset is not finite, 2: a scale is not finite, 4: a scale is
    negative); the values written for such a page are what the arithmetic gives. ``axis="channel"``: the groups
    run along the channels of each token (values per channel), metadata ``[H, n, ceil(D/C)]``.
    ``rotated``: the codes are of Hadamard-rotated keys, rotated back in the same pass."""
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
    _parallel(rotate_kernel, h * t, (buf, x0, sh, st, t, d, rotation.block_size(d), np.float32(2.0**-k),
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
        _parallel(pack4_rows_kernel, h * n, (buf, x0, sh, st, n, d, out.numpy()), (), min_units=1 << 12)
        return out
    flat = values.contiguous().view(-1)
    out = torch.empty(flat.numel() // 2, dtype=torch.uint8)
    if out.numel():  # rows of one pair
        _parallel(pack4_rows_kernel, out.numel(), (flat.numpy(), 0, 0, 2, out.numel(), 2, out.numpy()), (),
                  min_units=1 << 18)
    return out


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack4`."""
    flat = packed.contiguous().view(-1)
    out = torch.empty(flat.numel() * 2, dtype=torch.uint8)
    _parallel(unpack4_kernel, flat.numel(), (flat.numpy(), out.numpy()), (), min_units=1 << 18)
    return out
