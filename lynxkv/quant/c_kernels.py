"""The compiled C kernels of the fast CPU path (``lynxkv/quant/_native.c``, a cffi module whose C types are those
of ``_native.h``) and one Python call per kernel (:mod:`lynxkv.quant.fast` lays the tensors out and splits the work
over threads). Arrays are handed over as typed pointers into their buffers (``ffi.from_buffer``), so a call with a
missing or mistyped argument fails in Python, before any C runs."""

from __future__ import annotations

import numpy as np

from lynxkv.compiled import load_module
from lynxkv.quant.tables import LOG_POLY

#: ``(ffi, lib)`` of the compiled kernels, or None where they were not built or ``LYNXKV_NATIVE=0``: then
#: :func:`lynxkv.quant.fast.available` is false and the entry uses the reference.
FFI, NATIVE = load_module("lynxkv.quant._native") or (None, None)
_LOG_POLY_F32 = np.array(LOG_POLY, dtype=np.float32)


def native() -> str | None:
    """Which compiled kernels run: ``"avx2"`` (the vector rows), ``"scalar"`` (the C loops without them), or None
    (not built: the entry uses the reference)."""
    if NATIVE is None:
        return None
    return "avx2" if NATIVE.lynx_vector_rows() else "scalar"


def byte_pointer(a: np.ndarray):
    """A ``uint8_t *`` into ``a``'s bytes (C-contiguous), which keeps ``a`` alive: for buffers that several calls
    read (:func:`decode_kernel`)."""
    return FFI.from_buffer("uint8_t[]", a)


def _buf(a: np.ndarray, ctype: str = "char[]"):
    """A pointer into ``a``'s buffer (C-contiguous), of ``ctype`` (an array type, e.g. ``"float[]"``)."""
    return FFI.from_buffer(ctype, a)


def encode_kernel(x, x0, sh, st, T, D, C, nc, per_row, block, rotation_scale, u0, u1, meta_given, offset, scale,
                   alpha, inv_c, gk, gb, margin, table, off, shift, rb, packed, a_out, r_out, out_h, out_t):
    """Metadata and codes of units ``[u0, u1)`` (``lynx_encode_units``, whose comment documents the arguments);
    returns problem flags: 1 = the input is not finite, 2 = a centre overflows the metadata dtype, 4 = a scale
    does.

    Groups along tokens (keys): a unit is one (head, chunk of C tokens), the groups its D channels, metadata
    ``[H·nc·D]``. ``per_row`` (values per channel): a unit is one (head, token) row, the groups its
    runs of C channels, metadata ``[H·T·ceil(D/C)]``. ``offset``/``scale`` (fp32, or fp16 as uint16 bits) are
    written from each group's max and min (midrange centring), or read (``meta_given``: the reference computed
    them). Codes go out packed 4+4 (``packed``; pairs along D, ``[H·T·D/2]`` bytes each) or as anchor and residual
    bytes, element ``(h, t, d)`` at ``h·out_h + t·out_t + d``. ``block`` > 1 (rotated keys, along tokens):
    each row is rotated first (the butterfly within blocks of ``block`` channels, then times ``rotation_scale``)."""
    flags = NATIVE.lynx_encode_units(
        _buf(x), x.dtype == np.uint16, x0, sh, st, T, D, C, nc, per_row, block, rotation_scale, u0, u1,
        meta_given, _buf(offset), _buf(scale), offset.dtype == np.uint16, alpha, inv_c, gk, gb, margin,
        _buf(_LOG_POLY_F32, "float[]"), _buf(table, "uint32_t[]"), off, shift, rb, packed,
        _buf(a_out, "uint8_t[]"), _buf(r_out, "uint8_t[]"), out_h, out_t)
    if flags < 0:
        raise MemoryError("the encode's unit buffers could not be allocated")
    return flags


def decode_kernel(o_buf, s_buf, a_buf, r_buf, pages: np.ndarray, packed, anchor_only, rb, wide,
                   per_row, block, back, H, C, u0, u1, levels: np.ndarray, y: int, y_bf16: bool, sh, st, sd):
    """``x̂ = o + s·levels[code]`` for units ``[u0, u1)`` into ``y`` (the address of fp32, or of bf16 as uint16
    bits: ``y_bf16``) by ``lynx_decode_pages``; ``o_buf``/``s_buf``/``a_buf``/``r_buf`` are the byte buffers
    (:func:`byte_pointer`); returns metadata problem flags: 1 = an offset is not finite, 2 = a scale is not
    finite, 4 = a scale is negative.

    ``pages`` int64 ``[P, 10]``, one row per page of ``rows x cols`` elements per head: byte offsets of its
    offsets and scales (``[H, ceil(held/C), cols]``, little-endian fp16, or fp32 when ``wide``) in
    ``o_buf``/``s_buf`` and of its codes (``[H, held, cols]`` and ``[H, residual held, cols]`` row-major) in
    ``a_buf``/``r_buf``, the element offset in ``y`` of its first element, ``rows``, ``cols``, ``held`` and
    ``residual held`` (the rows per head its arrays hold, of which the first ``rows`` are decoded) and its first
    unit (a unit is one (head, chunk) of one page; units are numbered page after page). Codes are packed 4+4
    (``packed``: two per byte, the first in the low nibble; ``cols`` even)
    or one byte each; ``anchor_only`` indexes ``levels`` by the anchor. Element (h, t, d) of a page goes to
    ``y[y0 + h·sh + t·st + d·sd]``: any strided view. ``per_row``: the groups run along each row instead (values
    per channel), metadata ``[H, rows, ceil(cols/C)]``, a unit one (head, row). ``block`` > 1: the codes are of
    Hadamard-rotated rows (keys), each decoded fp32 row rotated back (the butterfly, then times
    ``back``) before it is stored."""
    flags = NATIVE.lynx_decode_pages(
        o_buf, s_buf, a_buf, r_buf, _buf(pages, "int64_t[]"), pages.shape[0], packed, anchor_only, rb, wide,
        per_row, block, back, H, C, u0, u1, _buf(levels, "float[]"), FFI.cast("void *", y), y_bf16, sh, st, sd)
    if flags < 0:
        raise MemoryError("the decode's row buffer could not be allocated")
    return flags


def rotate_kernel(x, x0, sh, st, T, D, block, scale, y, r0, r1):
    return NATIVE.lynx_rotate_rows(_buf(x), x.dtype == np.uint16, x0, sh, st, T, D, block, scale,
                                   _buf(y, "float[]"), r0, r1)


def pack4_rows_kernel(v, v0, sh, st, n, D, out, r0, r1):
    return NATIVE.lynx_pack4_rows(_buf(v, "uint8_t[]"), v0, sh, st, n, D, _buf(out, "uint8_t[]"), r0, r1)


def unpack4_kernel(p, out, i0, i1):
    return NATIVE.lynx_unpack4(_buf(p, "uint8_t[]"), _buf(out, "uint8_t[]"), i0, i1)
