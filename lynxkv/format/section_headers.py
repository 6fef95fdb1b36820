"""The headers of the sections that may live in their own files: the residual header and the exact header,
frozen dataclasses <-> bytes, with the structural checks of spec/FORMAT.md and the check that a section belongs
to its anchor header. No torch, no file I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from lynxkv.errors import FormatError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.headers import AnchorHeader, check_header_crc, check_prefix, check_range
from lynxkv.format.layout import field_error as _err

_RESIDUAL = struct.Struct(c.RESIDUAL_STRUCT)
_EXACT = struct.Struct(c.EXACT_STRUCT)
assert _RESIDUAL.size == c.RESIDUAL_HEADER_SIZE and _EXACT.size == c.EXACT_HEADER_SIZE


@dataclass(frozen=True)
class ResidualHeader:
    cache_id: bytes
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    page: int
    residual_bits: int
    index_crc32: int
    flags: int = 0
    version_minor: int = c.VERSION_MINOR
    header_length: int = c.RESIDUAL_HEADER_SIZE


@dataclass(frozen=True)
class ExactHeader:
    """The header of an exact-remainder section: bound to its anchor by ``cache_id`` and the shape."""

    cache_id: bytes
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    page: int
    dtype: str  # the original dtype: fp32 | fp16 | bf16
    index_crc32: int
    coding: int = c.EXACT_CODING_PLANES
    flags: int = 0
    version_minor: int = c.VERSION_MINOR
    header_length: int = c.EXACT_HEADER_SIZE


# ---------------------------------------------------------------------------------------------------------
# residual header
# ---------------------------------------------------------------------------------------------------------
def pack_residual_header(h: ResidualHeader) -> bytes:
    body = _RESIDUAL.pack(c.RESIDUAL_MAGIC, c.VERSION_MAJOR, h.version_minor, h.flags, c.RESIDUAL_HEADER_SIZE, 0,
                          h.cache_id, h.layers, h.kv_heads, h.head_dim, h.tokens, h.page, h.residual_bits,
                          b"\0\0\0", h.index_crc32, 0)
    return body[: -c.CRC_SIZE] + struct.pack("<I", crc32(body[: -c.CRC_SIZE]))


def parse_residual_header(buf, section_size: int | None = None) -> ResidualHeader:
    what = "residual"
    minor, flags, length = check_prefix(buf, c.RESIDUAL_MAGIC, c.KNOWN_RESIDUAL_FLAGS, c.RESIDUAL_HEADER_SIZE,
                                        c.RESIDUAL_HEADER_SIZE, section_size, what)
    check_header_crc(buf, length, what)
    (_, _, _, _, _, reserved0, cache_id, layers, kv_heads, head_dim, tokens, page, residual_bits, reserved1,
     index_crc, _) = _RESIDUAL.unpack_from(buf, 0)
    off = c.RESIDUAL_FIELD_OFFSETS
    if reserved0:
        raise _err("reserved0", f"{what} byte {off['reserved0']}", 0, reserved0)
    if any(reserved1):
        raise _err("reserved1", f"{what} byte {off['reserved1']}", "00" * 3, reserved1.hex())
    _check_shape(off, what, layers, kv_heads, head_dim, tokens, page)
    check_range("residual_bits", residual_bits, 7, off, what, 1)
    return ResidualHeader(bytes(cache_id), layers, kv_heads, head_dim, tokens, page, residual_bits, index_crc,
                          flags, minor, length)


def check_residual_matches(a: AnchorHeader, r: ResidualHeader) -> None:
    """The residual header must belong to this anchor header (same cache id, same counts)."""
    _check_belongs(a, r, "residual", "the residual", c.RESIDUAL_FIELD_OFFSETS,
                   (("residual_bits", a.scheme.residual_bits, r.residual_bits),))



# ---------------------------------------------------------------------------------------------------------
# exact header
# ---------------------------------------------------------------------------------------------------------
def pack_exact_header(h: ExactHeader) -> bytes:
    body = _EXACT.pack(c.EXACT_MAGIC, c.VERSION_MAJOR, h.version_minor, h.flags, c.EXACT_HEADER_SIZE, 0, h.cache_id,
                       h.layers, h.kv_heads, h.head_dim, h.tokens, h.page, c.DTYPE_CODES[h.dtype], h.coding, b"\0\0",
                       h.index_crc32, 0)
    return body[: -c.CRC_SIZE] + struct.pack("<I", crc32(body[: -c.CRC_SIZE]))


def parse_exact_header(buf, section_size: int | None = None) -> ExactHeader:
    what = "exact"
    minor, flags, length = check_prefix(buf, c.EXACT_MAGIC, c.KNOWN_EXACT_FLAGS, c.EXACT_HEADER_SIZE,
                                        c.EXACT_HEADER_SIZE, section_size, what)
    check_header_crc(buf, length, what)
    (_, _, _, _, _, reserved0, cache_id, layers, kv_heads, head_dim, tokens, page, dtype, coding, reserved1,
     index_crc, _) = _EXACT.unpack_from(buf, 0)
    off = c.EXACT_FIELD_OFFSETS
    if reserved0:
        raise _err("reserved0", f"{what} byte {off['reserved0']}", 0, reserved0)
    if any(reserved1):
        raise _err("reserved1", f"{what} byte {off['reserved1']}", "00" * 2, reserved1.hex())
    _check_shape(off, what, layers, kv_heads, head_dim, tokens, page)
    names = {v: k for k, v in c.DTYPE_CODES.items()}
    if dtype not in names:
        raise _err("dtype", f"{what} byte {off['dtype']}", f"one of {sorted(names)}", dtype)
    if coding not in c.EXACT_CODINGS:
        raise _err("coding", f"{what} byte {off['coding']}", f"one of {sorted(c.EXACT_CODINGS)}", coding)
    return ExactHeader(bytes(cache_id), layers, kv_heads, head_dim, tokens, page, names[dtype], index_crc, coding,
                       flags, minor, length)


def check_exact_matches(a: AnchorHeader, e: ExactHeader) -> None:
    """The exact header must belong to this anchor header (same cache id, same shape and dtype)."""
    _check_belongs(a, e, "exact", "the exact segment", c.EXACT_FIELD_OFFSETS, (("dtype", a.dtype, e.dtype),))


def _check_shape(off: dict, what: str, layers: int, kv_heads: int, head_dim: int, tokens: int, page: int) -> None:
    """The cache shape a residual or exact header repeats, each count within the format's bounds."""
    check_range("layers", layers, c.MAX_LAYERS, off, what, 1)
    check_range("kv_heads", kv_heads, c.MAX_KV_HEADS, off, what, 1)
    check_range("head_dim", head_dim, c.MAX_HEAD_DIM, off, what, 1)
    check_range("tokens", tokens, c.MAX_TOKENS, off, what)
    check_range("page", page, 1 << 16, off, what, 1)


def _check_belongs(a: AnchorHeader, h, what: str, noun: str, off: dict, more: tuple) -> None:
    """Header ``h`` of segment ``what`` belongs to anchor header ``a``: the same cache id, the same counts, and the
    same ``more`` (name, anchor's value, header's value) fields."""
    if h.cache_id != a.cache_id:
        raise FormatError(
            f"`cache_id` at {what} byte 24: {noun} belongs to another cache "
            f"(expected {a.cache_id.hex()}, got {h.cache_id.hex()})", field="cache_id", where=f"{what} byte 24")
    for name, want, got in (("layers", a.layers, h.layers), ("kv_heads", a.kv_heads, h.kv_heads),
                            ("head_dim", a.head_dim, h.head_dim), ("tokens", a.tokens, h.tokens),
                            ("page", a.scheme.page, h.page), *more):
        if want != got:
            raise _err(name, f"{what} byte {off[name]}", f"{want} (as in the anchor header)", got)
