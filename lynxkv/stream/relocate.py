"""Small adapters over the format's public functions for moving segments between tiers.

- :func:`relocate_residual`: the anchor file's bytes with a new residual location in its header. The anchor
  section (index and pages) is copied unchanged; only the header, whose length depends on the location string,
  is rebuilt, and the anchor section's offset in the segment table follows it (the same two-step packing the
  writer uses). Page offsets in the index are relative to the section, so they stay valid.
- :func:`check_segment_bytes`: every structure and page checksum of one segment's complete bytes, so a copy
  can be checked before it is published under its real name.
"""

from __future__ import annotations

from dataclasses import replace

from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.layout import AnchorHeader, pack_anchor_header
from lynxkv.format.reader import (
    BytesSource,
    decode_anchor_page,
    decode_residual_page,
    read_anchor_header,
    read_anchor_index,
    read_residual_section,
)


def anchor_header_of(anchor: bytes) -> AnchorHeader:
    return read_anchor_header(BytesSource(anchor, "anchor"))


def relocate_residual(anchor: bytes, location: str) -> bytes:
    """The anchor file ``anchor`` with its external residual recorded at ``location`` (relative path or URL)."""
    h = anchor_header_of(anchor)
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None or seg.placement != c.PLACEMENT_EXTERNAL:
        raise InputError("this cache keeps its residual inside the anchor file; there is no location to change")
    if len(location.encode("utf-8")) > c.MAX_LOCATION:
        raise InputError(f"residual location: at most {c.MAX_LOCATION} bytes")
    a_seg = h.segments[0]
    section = anchor[a_seg.offset:a_seg.offset + a_seg.length]

    def header(offset: int) -> AnchorHeader:
        segs = tuple(replace(s, offset=offset) if s.kind == c.SEGMENT_ANCHOR else
                     replace(s, location=location) if s.kind == c.SEGMENT_RESIDUAL else s for s in h.segments)
        return replace(h, segments=segs)

    length = len(pack_anchor_header(header(0)))
    out = pack_anchor_header(header(length)) + section
    anchor_header_of(out)  # the rebuilt header must parse (and the file length be exact)
    return out


def check_segment_bytes(kind: str, data: bytes, anchor: bytes | None = None) -> int:
    """Check every header, index and page CRC of a complete segment; return the number of pages checked.

    ``kind`` is ``"anchor"`` (``data`` is the anchor file) or ``"residual"`` (``data`` is the residual file and
    ``anchor`` the anchor file it belongs to: the residual is bound to its anchor's cache id)."""
    if kind == "anchor":
        src = BytesSource(data, "anchor")
        h = read_anchor_header(src)
        index, decode = read_anchor_index(src, h), decode_anchor_page
    else:
        if anchor is None:
            raise InputError("checking a residual needs its anchor")
        h = anchor_header_of(anchor)
        src = BytesSource(data, "residual")
        _, index = read_residual_section(src, h, base=0)
        decode = decode_residual_page
    ppl = index.pages_per_layer
    for i, e in enumerate(index.entries):
        layer, page = divmod(i, ppl)
        decode(src.read(index.base + e.offset, e.stored_length), e, h, layer, page)
    return len(index.entries)
