"""The ``.lynx`` file format, version 1 (normative description: spec/FORMAT.md).

Modules, in data-flow order:

- :mod:`~lynxkv.format.constants` -- the spec's tables as constants (magic, struct layouts, codes, caps);
- :mod:`~lynxkv.format.layout` -- headers, segment table and page index <-> bytes, with validation (no torch);
- :mod:`~lynxkv.format.records` -- one page record <-> tensors, CRC check and zstd codec;
- :mod:`~lynxkv.format.writer` -- :func:`build_files` (exact bytes) and :func:`write_atomic`;
- :mod:`~lynxkv.format.reader` -- byte sources (bytes, mmap, file objects) and the three public reading steps
  (header from bytes, where the pages are, decode one page from its bytes);
- :mod:`~lynxkv.format.verify` -- every finding about a possibly damaged cache.

Most users want the high-level API in :mod:`lynxkv.cache` (``save_cache``, ``open_cache``).
"""

from lynxkv.format.layout import (
    AnchorHeader,
    PageEntry,
    ResidualHeader,
    SegmentEntry,
    parse_anchor_header,
    parse_residual_header,
)
from lynxkv.format.reader import (
    SectionIndex,
    as_source,
    decode_anchor_page,
    decode_residual_page,
    read_anchor_header,
    read_anchor_index,
    read_page,
    read_residual_section,
)
from lynxkv.format.records import AnchorPage, ResidualPage
from lynxkv.format.verify import Finding, verify_cache
from lynxkv.format.writer import build_files, write_atomic

__all__ = [
    "AnchorHeader",
    "AnchorPage",
    "Finding",
    "PageEntry",
    "ResidualHeader",
    "ResidualPage",
    "SectionIndex",
    "SegmentEntry",
    "as_source",
    "build_files",
    "decode_anchor_page",
    "decode_residual_page",
    "parse_anchor_header",
    "parse_residual_header",
    "read_anchor_header",
    "read_anchor_index",
    "read_page",
    "read_residual_section",
    "verify_cache",
    "write_atomic",
]
