"""The ``.lynx`` format 1.0 (spec/FORMAT.md): headers, page indexes and page records <-> bytes, no I/O."""

from lynxkv.format.headers import PREFIX_SIZE, AnchorHeader, SegmentEntry, anchor_header_length, parse_anchor_header
from lynxkv.format.layout import PageEntry
from lynxkv.format.section_headers import ResidualHeader, check_residual_matches, parse_residual_header
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
