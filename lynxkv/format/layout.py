"""Where the bytes of a page lie: record layouts (the sizes inside one page record), page sizes and sink tokens,
and the page index <-> bytes, with validation (spec/FORMAT.md "Page index", "Page records").

Byte layout only: no torch, no file I/O, no policy. Every error is a :class:`FormatError` (or
:class:`ChecksumError`) whose message names the field, where it sits, what was expected and what was found.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from lynxkv.errors import ChecksumError, FormatError
from lynxkv.format import constants as c
from lynxkv.quant.scheme import Scheme

_PAGE = struct.Struct(c.PAGE_ENTRY_STRUCT)
assert _PAGE.size == c.PAGE_ENTRY_SIZE  # the table adds up


def field_error(field_name: str, at: str, expected, got, *, checksum: bool = False) -> FormatError:
    """The error for one field: its name, where it sits, what was expected and what was found."""
    cls = ChecksumError if checksum else FormatError
    return cls(f"`{field_name}` at {at}: expected {expected}, got {got}", field=field_name, where=at)


@dataclass(frozen=True)
class PageEntry:
    offset: int  # from the start of the section
    stored_length: int
    raw_length: int
    codec: int
    crc32: int


@dataclass(frozen=True)
class RecordLayout:
    """Byte sizes inside one raw page record of ``tokens`` tokens (spec "Page records")."""

    tokens: int
    meta_size: int  # one key metadata array, [H, nc, D] (offsets or scales)
    codes_size: int  # one packed [H, n, D] code array (K or V)
    meta_arrays: int  # 4 for an anchor record (K off, K scale, V off, V scale), 0 for a residual record
    value_meta_size: int = -1  # one value metadata array: [H, nc, D], or [H, n, ceil(D/C)] per channel (-1: as K)
    sinks: int = 0  # anchor record: S, the page's sink tokens, whose residual codes it carries
    sink_size: int = 0  # one packed [H, S, D] residual array (K or V) of those tokens

    @property
    def value_meta(self) -> int:
        return self.meta_size if self.value_meta_size < 0 else self.value_meta_size

    @property
    def raw_length(self) -> int:
        return (self.meta_arrays // 2) * (self.meta_size + self.value_meta) + 2 * self.codes_size + 2 * self.sink_size


def packed_size(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def page_tokens(tokens: int, page: int, p: int) -> int:
    """Tokens held by page ``p`` (the last page may be shorter than ``page``)."""
    return min(page, tokens - p * page)


def anchor_record_layout(scheme: Scheme, kv_heads: int, head_dim: int, n: int, sinks: int = 0) -> RecordLayout:
    """The anchor record of a page of ``n`` tokens whose first ``sinks`` tokens are sink tokens."""
    nc = -(-n // scheme.chunk)
    key_meta = kv_heads * nc * head_dim * scheme.meta_bytes
    value_meta = (kv_heads * n * -(-head_dim // scheme.chunk) * scheme.meta_bytes if scheme.value_axis == "channel"
                  else key_meta)
    return RecordLayout(n, key_meta, packed_size(kv_heads * n * head_dim, scheme.anchor_bits), 4, value_meta,
                        sinks, packed_size(kv_heads * sinks * head_dim, scheme.residual_bits))


def sinks_in(scheme: Scheme, t0: int, n: int) -> int:
    """Sink tokens among the tokens ``[t0, t0 + n)``: the first ``sink_tokens`` tokens of the cache."""
    return max(0, min(scheme.sink_tokens, t0 + n) - t0)


def page_sinks(scheme: Scheme, tokens: int, p: int) -> int:
    """Sink tokens held by page ``p`` (usually all in page 0)."""
    return sinks_in(scheme, p * scheme.page, page_tokens(tokens, scheme.page, p))


def residual_record_layout(scheme: Scheme, kv_heads: int, head_dim: int, n: int) -> RecordLayout:
    return RecordLayout(n, 0, packed_size(kv_heads * n * head_dim, scheme.residual_bits), 0)



# ---------------------------------------------------------------------------------------------------------
# page index
# ---------------------------------------------------------------------------------------------------------
def pack_index(entries: list[PageEntry]) -> bytes:
    return b"".join(_PAGE.pack(e.offset, e.stored_length, e.raw_length, e.codec, b"\0\0\0", e.crc32)
                    for e in entries)


def parse_index(buf, count: int, *, first_offset: int, section_length: int, raw_lengths: list[int],
                segment: str, pages_per_layer: int, index_at: int) -> list[PageEntry]:
    """Parse ``count`` entries and check them: codec known, reserved zero, raw length as the shape implies, stored
    length consistent with the codec, offsets contiguous from ``first_offset`` to ``section_length``."""
    entries = []
    pos = first_offset
    for i in range(count):
        off, stored, raw, codec, reserved, crc = _PAGE.unpack_from(buf, i * c.PAGE_ENTRY_SIZE)
        layer, page = divmod(i, pages_per_layer)
        at = f"{segment} index entry {i} (layer {layer}, page {page}), byte {index_at + i * c.PAGE_ENTRY_SIZE}"
        if any(reserved):
            raise field_error("page.reserved", at, "000000", reserved.hex())
        if codec not in c.CODEC_NAMES:
            raise field_error("page.codec", at, f"one of {sorted(c.CODEC_NAMES)}", codec)
        if codec == c.CODEC_ZSTD_FRAMES and segment != c.SEGMENT_KINDS[c.SEGMENT_EXACT]:
            raise field_error("page.codec", at, "0 or 1 (codec 2 is for exact pages only)", codec)
        if raw != raw_lengths[i]:
            raise field_error("page.raw_length", at, raw_lengths[i], raw)
        if codec == c.CODEC_NONE and stored != raw:
            raise field_error("page.stored_length", at, f"raw_length {raw} for codec none", stored)
        if off != pos:
            raise field_error("page.offset", at, f"{pos} (pages are contiguous)", off)
        if off + stored > section_length:
            raise field_error("page.stored_length", at, f"<= {section_length - off} (section ends at {section_length})",
                       stored)
        pos += stored
        entries.append(PageEntry(off, stored, raw, codec, crc))
    if pos != section_length:
        raise FormatError(f"`{segment}.length`: pages end at {pos} but the section is {section_length} bytes "
                          "(no holes, no trailing bytes)", field=f"{segment}.length", where=segment)
    return entries

