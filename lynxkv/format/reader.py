"""Reading ``.lynx`` v1 from anything that serves byte ranges: raw bytes, a local file (mmap), a file object.

The reading steps are public and separate so that a transport (fsspec, TCP, an emulated link) can drive them
with its own byte-range reads:

1. :func:`read_anchor_header` / :func:`layout.parse_anchor_header` -- the header from its bytes;
2. :func:`read_anchor_index` / :func:`read_residual_section` -- where the pages are (a :class:`SectionIndex`
   with absolute byte spans per (layer, page), in streaming order);
3. :func:`decode_anchor_page` / :func:`decode_residual_page` -- one page record from its stored bytes,
   checking its CRC-32 first.

A source is any object with ``size`` (bytes) and ``read(offset, length) -> bytes``; :func:`as_source` wraps
paths (mmap), bytes-like objects and seekable file objects. Reads never go past ``size`` and nothing is
allocated from a header's claims before the claims have been checked against caps and the source size.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lynxkv.errors import ChecksumError, FormatError, InputError
from lynxkv.format import constants as c
from lynxkv.format.layout import (
    PREFIX_SIZE,
    AnchorHeader,
    PageEntry,
    ResidualHeader,
    SegmentEntry,
    anchor_header_length,
    anchor_record_layout,
    check_residual_matches,
    crc32,
    inline_end,
    page_tokens,
    parse_anchor_header,
    parse_index,
    parse_residual_header,
    raw_lengths,
    residual_record_layout,
)
from lynxkv.format.records import (
    AnchorPage,
    ResidualPage,
    check_and_decompress,
    decode_anchor_record,
    decode_residual_record,
)


# ---------------------------------------------------------------------------------------------------------
# byte sources
# ---------------------------------------------------------------------------------------------------------
class ByteSource(Protocol):
    size: int

    def read(self, offset: int, length: int) -> bytes: ...


class BytesSource:
    """Bytes already in memory."""

    def __init__(self, data, name: str = "<bytes>"):
        self._data = memoryview(data).cast("B")
        self.size = len(self._data)
        self.name = name

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._data[offset:offset + length])

    def close(self) -> None:
        pass


class FileSource:
    """A local file, memory-mapped: reading one page touches only that page's bytes."""

    def __init__(self, path: str | os.PathLike):
        self.name = str(path)
        try:
            self._f = open(path, "rb")
        except OSError as exc:
            raise InputError(f"{path}: cannot open ({exc.strerror or exc})") from None
        self.size = os.fstat(self._f.fileno()).st_size
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None

    def read(self, offset: int, length: int) -> bytes:
        if self._mm is None:
            return b""
        return self._mm[offset:offset + length]

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._f.close()


class FileObjSource:
    """A seekable binary file object (e.g. an fsspec file doing HTTP/S3 range requests)."""

    def __init__(self, f, name: str = "<file>", size: int | None = None):
        self._f = f
        self.name = name
        self._lock = threading.Lock()
        if size is None:
            size = f.seek(0, io.SEEK_END)
        self.size = int(size)

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            self._f.seek(offset)
            return self._f.read(max(0, min(length, self.size - offset)))

    def close(self) -> None:
        close = getattr(self._f, "close", None)
        if close:
            close()


def as_source(obj, name: str | None = None):
    """A byte source for a path, a bytes-like object, a seekable file object, or a source itself."""
    if isinstance(obj, (str, os.PathLike)):
        text = str(obj)
        if "://" in text and not text.startswith("file://"):
            import fsspec

            try:
                f = fsspec.open(text, "rb").open()
            except Exception as exc:  # fsspec raises backend-specific errors
                raise InputError(f"{text}: cannot open ({exc})") from None
            return FileObjSource(f, text)
        return FileSource(text[len("file://"):] if text.startswith("file://") else text)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return BytesSource(obj, name or "<bytes>")
    if hasattr(obj, "size") and hasattr(obj, "read") and not hasattr(obj, "seek"):
        return obj
    if hasattr(obj, "seek") and hasattr(obj, "read"):
        return FileObjSource(obj, name or getattr(obj, "name", "<file>"))
    raise InputError(f"cannot read a .lynx cache from a {type(obj).__name__}")


def _read_exact(src, offset: int, length: int, field: str, what: str) -> bytes:
    if offset + length > src.size:
        raise FormatError(f"`{field}` at {what} byte {offset}: expected {length} bytes, the file ends at {src.size} "
                          "(truncated)", field=field, where=f"{what} byte {offset}")
    data = src.read(offset, length)
    if len(data) != length:
        raise FormatError(f"`{field}` at {what} byte {offset}: expected {length} bytes, read {len(data)}",
                          field=field, where=f"{what} byte {offset}")
    return data


# ---------------------------------------------------------------------------------------------------------
# headers and indexes
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SectionIndex:
    """Where the pages of one segment are: absolute byte spans in the source holding the section."""

    kind: int
    base: int  # absolute offset of the section in its source
    entries: tuple[PageEntry, ...]  # layer-major: layer 0 pages 0..n-1, layer 1 ...
    pages_per_layer: int

    @property
    def name(self) -> str:
        return c.SEGMENT_KINDS.get(self.kind, f"segment{self.kind}")

    def entry(self, layer: int, page: int) -> PageEntry:
        if not (0 <= page < self.pages_per_layer) or not (0 <= layer < len(self.entries) // max(self.pages_per_layer, 1)):
            raise InputError(f"{self.name} page (layer {layer}, page {page}) does not exist")
        return self.entries[layer * self.pages_per_layer + page]

    def span(self, layer: int, page: int) -> tuple[int, int]:
        """(absolute offset, stored length) of page ``page`` of layer ``layer``."""
        e = self.entry(layer, page)
        return self.base + e.offset, e.stored_length

    @property
    def stored_bytes(self) -> int:
        return sum(e.stored_length for e in self.entries)

    @property
    def raw_bytes(self) -> int:
        return sum(e.raw_length for e in self.entries)


def read_anchor_header(src, *, exact_size: bool = True) -> AnchorHeader:
    """Read and validate the anchor header; with ``exact_size`` also check the file length is exact."""
    prefix = src.read(0, min(PREFIX_SIZE, src.size))
    length = anchor_header_length(prefix, src.size)
    h = parse_anchor_header(_read_exact(src, 0, length, "header", "anchor"), src.size)
    if exact_size:
        end = inline_end(h)
        if end != src.size:
            raise FormatError(f"`file_length` of anchor: expected {end} bytes (header + inline sections), got "
                              f"{src.size} ({'truncated' if src.size < end else 'trailing bytes'})",
                              field="file_length", where="anchor")
    return h


def _index(src, h: AnchorHeader, seg: SegmentEntry, base: int, index_at: int, first_page: int,
           expected_crcs: list[int], name: str) -> SectionIndex:
    size = seg.page_count * c.PAGE_ENTRY_SIZE
    if first_page - index_at != size or first_page > seg.length:
        raise FormatError(f"`{name}.length`: expected >= {first_page} bytes for the header and the index of "
                          f"{seg.page_count} pages, got {seg.length}", field=f"{name}.length", where=name)
    buf = _read_exact(src, base + index_at, size, f"{name}.index", name)
    got = crc32(buf)
    for want in expected_crcs:
        if got != want:
            raise ChecksumError(f"`{name}.index_crc32` of the {name} page index at byte {base + index_at}: expected "
                                f"{want:#010x}, got {got:#010x}", field=f"{name}.index_crc32", where=f"{name} index")
    entries = parse_index(buf, seg.page_count, first_offset=first_page, section_length=seg.length,
                          raw_lengths=raw_lengths(h, seg.kind), segment=name,
                          pages_per_layer=max(h.pages_per_layer, 1), index_at=base + index_at)
    return SectionIndex(seg.kind, base, tuple(entries), h.pages_per_layer)


def read_anchor_index(src, h: AnchorHeader) -> SectionIndex:
    """The anchor page index (checked against the segment table's index CRC and the section length)."""
    seg = h.segments[0]
    return _index(src, h, seg, seg.offset, 0, seg.page_count * c.PAGE_ENTRY_SIZE, [seg.index_crc32], "anchor")


def read_residual_section(src, h: AnchorHeader, *, base: int | None = None) -> tuple[ResidualHeader, SectionIndex]:
    """The residual header and index from ``src`` (the residual file, or the anchor file itself when inline).

    The residual must carry the anchor's cache id and counts, and its index CRC must match both its own
    header and the anchor's segment table.
    """
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None:
        raise FormatError("`segments`: this cache has no residual segment", field="segments", where="anchor")
    if base is None:
        base = seg.offset if seg.placement == c.PLACEMENT_INLINE else 0
    if seg.placement == c.PLACEMENT_EXTERNAL and src.size != seg.length:
        kind = "truncated" if src.size < seg.length else "trailing bytes"
        # A different size may also mean another cache's residual: read its header first to say so.
        if src.size >= c.RESIDUAL_HEADER_SIZE:
            try:
                check_residual_matches(h, parse_residual_header(src.read(0, c.RESIDUAL_HEADER_SIZE)))
            except FormatError as exc:
                if exc.field == "cache_id":
                    raise
        raise FormatError(f"`file_length` of residual: expected {seg.length} bytes (as the anchor header says), "
                          f"got {src.size} ({kind})", field="file_length", where="residual")
    head = _read_exact(src, base, c.RESIDUAL_HEADER_SIZE, "residual.header", "residual")
    rh = parse_residual_header(head, seg.length)
    check_residual_matches(h, rh)
    index = _index(src, h, seg, base, c.RESIDUAL_HEADER_SIZE,
                   c.RESIDUAL_HEADER_SIZE + seg.page_count * c.PAGE_ENTRY_SIZE,
                   [seg.index_crc32, rh.index_crc32], "residual")
    return rh, index


# ---------------------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------------------
def _where(segment: str, layer: int, page: int) -> str:
    return f"{segment} layer {layer} page {page}"


def decode_anchor_page(stored, entry: PageEntry, h: AnchorHeader, layer: int, page: int) -> AnchorPage:
    """Decode the anchor record of (``layer``, ``page``) from its stored bytes (CRC checked first)."""
    where = _where("anchor", layer, page)
    raw = check_and_decompress(stored, entry, where)
    lay = anchor_record_layout(h.scheme, h.kv_heads, h.head_dim, page_tokens(h.tokens, h.scheme.page, page))
    return decode_anchor_record(raw, lay, h.scheme, h.kv_heads, h.head_dim, where)


def decode_residual_page(stored, entry: PageEntry, h: AnchorHeader, layer: int, page: int) -> ResidualPage:
    """Decode the residual record of (``layer``, ``page``) from its stored bytes (CRC checked first)."""
    where = _where("residual", layer, page)
    raw = check_and_decompress(stored, entry, where)
    lay = residual_record_layout(h.scheme, h.kv_heads, h.head_dim, page_tokens(h.tokens, h.scheme.page, page))
    return decode_residual_record(raw, lay, h.scheme, h.kv_heads, h.head_dim, where)


def read_page(src, index: SectionIndex, layer: int, page: int) -> bytes:
    """The stored bytes of one page (one byte-range read)."""
    offset, length = index.span(layer, page)
    return _read_exact(src, offset, length, "page", _where(index.name, layer, page))


def resolve_residual(anchor_name: str | None, location: str) -> str:
    """The residual location made usable: URLs as they are, relative paths against the anchor's directory."""
    if "://" in location or os.path.isabs(location) or anchor_name is None or anchor_name.startswith("<"):
        return location
    return str(Path(anchor_name).parent / location)
