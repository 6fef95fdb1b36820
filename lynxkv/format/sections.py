"""Reading a ``.lynx`` section's header and page index from a byte source: the anchor header (and the file's exact
length), the residual and exact headers bound to their anchor, and :class:`SectionIndex`, where each page of a
segment lies. :mod:`lynxkv.format.reader` reads the pages through these.
"""

from __future__ import annotations

from dataclasses import dataclass

from lynxkv.errors import ChecksumError, FormatError, InputError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.headers import (
    PREFIX_SIZE,
    AnchorHeader,
    anchor_header_length,
    inline_end,
    parse_anchor_header,
    raw_lengths,
)
from lynxkv.format.layout import PageEntry, parse_index
from lynxkv.format.section_headers import (
    ExactHeader,
    ResidualHeader,
    check_exact_matches,
    check_residual_matches,
    parse_exact_header,
    parse_residual_header,
)


def read_bytes(src, offset: int, length: int, field: str, what: str, in_place: bool = False) -> bytes:
    """``length`` bytes at ``offset`` or a FormatError naming the field; ``in_place``: a view of a memory-mapped
    file's bytes where the source has one (no copy), else a copy."""
    if offset + length > src.size:
        raise FormatError(f"`{field}` at {what} byte {offset}: expected {length} bytes, the file ends at {src.size} "
                          "(truncated)", field=field, where=f"{what} byte {offset}")
    view = getattr(src, "view", None) if in_place else None
    data = view(offset, length) if view else src.read(offset, length)
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
        layers = len(self.entries) // max(self.pages_per_layer, 1)
        if not (0 <= page < self.pages_per_layer and 0 <= layer < layers):
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
    h = parse_anchor_header(read_bytes(src, 0, length, "header", "anchor"), src.size)
    if exact_size:
        end = inline_end(h)
        if end != src.size:
            raise FormatError(f"`file_length` of anchor: expected {end} bytes (header + inline sections), got "
                              f"{src.size} ({'truncated' if src.size < end else 'trailing bytes'})",
                              field="file_length", where="anchor")
    return h


def index_span(h: AnchorHeader, kind: int) -> tuple[int, int]:
    """(offset of the page index from the start of its section, index size in bytes) for a segment kind."""
    seg = h.segment(kind)
    if seg is None:
        raise FormatError(f"`segments`: this cache has no {c.SEGMENT_KINDS.get(kind, kind)} segment",
                          field="segments", where="anchor")
    lead = {c.SEGMENT_RESIDUAL: c.RESIDUAL_HEADER_SIZE, c.SEGMENT_EXACT: c.EXACT_HEADER_SIZE}.get(kind, 0)
    return lead, seg.page_count * c.PAGE_ENTRY_SIZE


def parse_section_index(buf, h: AnchorHeader, kind: int, *, base: int,
                        residual_header: ResidualHeader | ExactHeader | None = None) -> SectionIndex:
    """Check and parse a section's page index from its bytes (``index_span`` says where they are); ``base``
    is the section's absolute offset in its source, kept so that :meth:`SectionIndex.span` is absolute."""
    seg = h.segment(kind)
    name = c.SEGMENT_KINDS.get(kind, f"segment{kind}")
    index_at, size = index_span(h, kind)
    first_page = index_at + size
    if first_page > seg.length:
        raise FormatError(f"`{name}.length`: expected >= {first_page} bytes for the header and the index of "
                          f"{seg.page_count} pages, got {seg.length}", field=f"{name}.length", where=name)
    if len(buf) != size:
        raise FormatError(f"`{name}.index` at {name} byte {base + index_at}: expected {size} bytes, got {len(buf)}",
                          field=f"{name}.index", where=name)
    got = crc32(buf)
    wants = [seg.index_crc32] + ([residual_header.index_crc32] if residual_header is not None else [])
    for want in wants:
        if got != want:
            raise ChecksumError(f"`{name}.index_crc32` of the {name} page index at byte {base + index_at}: expected "
                                f"{want:#010x}, got {got:#010x}", field=f"{name}.index_crc32", where=f"{name} index")
    entries = parse_index(buf, seg.page_count, first_offset=first_page, section_length=seg.length,
                          raw_lengths=raw_lengths(h, kind), segment=name,
                          pages_per_layer=max(h.pages_per_layer, 1), index_at=base + index_at)
    return SectionIndex(kind, base, tuple(entries), h.pages_per_layer)


def _index(src, h: AnchorHeader, kind: int, base: int,
           residual_header: ResidualHeader | ExactHeader | None = None) -> SectionIndex:
    index_at, size = index_span(h, kind)
    seg = h.segment(kind)
    name = c.SEGMENT_KINDS[kind]
    if index_at + size > seg.length:
        raise FormatError(f"`{name}.length`: expected >= {index_at + size} bytes for the header and the index of "
                          f"{seg.page_count} pages, got {seg.length}", field=f"{name}.length", where=name)
    buf = read_bytes(src, base + index_at, size, f"{name}.index", name)
    return parse_section_index(buf, h, kind, base=base, residual_header=residual_header)


def read_anchor_index(src, h: AnchorHeader) -> SectionIndex:
    """The anchor page index (checked against the segment table's index CRC and the section length)."""
    return _index(src, h, c.SEGMENT_ANCHOR, h.segments[0].offset)


def read_residual_section(src, h: AnchorHeader, *, base: int | None = None) -> tuple[ResidualHeader, SectionIndex]:
    """The residual header and index from ``src`` (the residual file, or the anchor file itself when inline).

    The residual must carry the anchor's cache id and counts, and its index CRC must match both its own
    header and the anchor's segment table.
    """
    return _side_section(src, h, c.SEGMENT_RESIDUAL, "residual", c.RESIDUAL_HEADER_SIZE, parse_residual_header,
                         check_residual_matches, base)


def read_exact_section(src, h: AnchorHeader, *, base: int | None = None) -> tuple[ExactHeader, SectionIndex]:
    """The exact header and index from ``src`` (its own file, or the anchor file when inline): bound to the
    anchor by cache id, shape and dtype; its index CRC must match its own header and the anchor's segment table."""
    return _side_section(src, h, c.SEGMENT_EXACT, "exact", c.EXACT_HEADER_SIZE, parse_exact_header,
                         check_exact_matches, base)


def _side_section(src, h: AnchorHeader, kind: int, name: str, header_size: int, parse, check, base: int | None):
    """The header and index of segment ``kind`` (residual or exact, called ``name``) from ``src``: its own file or,
    inline, the anchor file; the header parsed by ``parse`` and bound to the anchor's by ``check``."""
    seg = h.segment(kind)
    if seg is None:
        raise FormatError(f"`segments`: this cache has no {name} segment", field="segments", where="anchor")
    if base is None:
        base = seg.offset if seg.placement == c.PLACEMENT_INLINE else 0
    if seg.placement == c.PLACEMENT_EXTERNAL and src.size != seg.length:
        kind_of = "truncated" if src.size < seg.length else "trailing bytes"
        # A different size may also mean another cache's file: read its header first to say so.
        if src.size >= header_size:
            try:
                check(h, parse(src.read(0, header_size)))
            except FormatError as exc:
                if exc.field == "cache_id":
                    raise
        raise FormatError(f"`file_length` of {name}: expected {seg.length} bytes (as the anchor header says), "
                          f"got {src.size} ({kind_of})", field="file_length", where=name)
    head = read_bytes(src, base, header_size, f"{name}.header", name)
    sh = parse(head, seg.length)
    check(h, sh)
    return sh, _index(src, h, kind, base, sh)
