"""The ``.lynx`` file format, version 1 (normative description: spec/FORMAT.md): bytes only, no I/O.

Modules, in data-flow order:

- :mod:`~lynxkv.format.constants` -- the spec's tables as constants (magic, struct layouts, codes, caps);
- :mod:`~lynxkv.format.checksum` -- the CRC-32 of headers, indexes and pages (compiled where built, else zlib);
- :mod:`~lynxkv.format.headers` -- the anchor header (segment table, properties) and the residual header <-> bytes,
  with validation (no torch);
- :mod:`~lynxkv.format.layout` -- record layouts, page sizes and the page index <-> bytes, with validation;
- :mod:`~lynxkv.format.records` -- one page record <-> tensors (one decoder per record layout), CRC and zstd;
- :mod:`~lynxkv.format.writer` -- :func:`build_files`: the exact bytes of a cache's files;
- :mod:`~lynxkv.format.reader` -- :class:`PageReader`, the one page reader over byte sources (header, index,
  pages), and the reading steps it is made of;
- :mod:`~lynxkv.format.verify` -- every finding about a possibly damaged cache.

Opening files and URLs is :mod:`lynxkv.storage`'s job; most users want :mod:`lynxkv.cache` (``save_cache``,
``open_cache``).
"""

from lynxkv.format.headers import (
    PREFIX_SIZE,
    AnchorHeader,
    ResidualHeader,
    SegmentEntry,
    anchor_header_length,
    check_residual_matches,
    parse_anchor_header,
    parse_residual_header,
)
from lynxkv.format.layout import PageEntry
from lynxkv.format.reader import (
    PageReader,
    SectionIndex,
    decode_page,
    index_span,
    parse_section_index,
)
from lynxkv.format.records import AnchorPage, ResidualPage
from lynxkv.format.verify import Finding, verify_cache
from lynxkv.format.writer import build_files

__all__ = [
    "PREFIX_SIZE",
    "AnchorHeader",
    "AnchorPage",
    "Finding",
    "PageEntry",
    "PageReader",
    "ResidualHeader",
    "ResidualPage",
    "SectionIndex",
    "SegmentEntry",
    "anchor_header_length",
    "build_files",
    "check_residual_matches",
    "decode_page",
    "index_span",
    "parse_anchor_header",
    "parse_residual_header",
    "parse_section_index",
    "verify_cache",
]
