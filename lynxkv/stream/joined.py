"""Several stored caches read as one, joined along tokens: the page stream of an LMCache prefix.

An LMCache store keeps a prompt as N chunk objects of 256 tokens, each a complete cache of its own (one page per
layer). :func:`join_caches` makes the cache those N would be had they been saved as one: its headers and page
indexes are framed here (:func:`lynxkv.format.writer.frame_sections`) from theirs, and its pages are theirs,
byte for byte, in the joined streaming order (layer 0: every part's pages in token order, then layer 1 ...),
each entry keeping the CRC-32 its part's own index records. A reader of the joined cache therefore checks every
page against the checksum stored with the object it came from. Nothing is copied in advance:
:class:`JoinedSegment` turns a byte range of a joined segment into ranged reads of the parts' objects.

Pages are joined, never re-cut: every part but the last must hold whole pages (``tokens`` a multiple of the
scheme's page), all parts must share shape, dtype, scheme and model fingerprint, and only a joined cache's start
may hold sink tokens, so the schemes have none (:func:`join_problem`).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, replace

from lynxkv.errors import FormatError, InputError
from lynxkv.format import constants as c
from lynxkv.format.headers import AnchorHeader
from lynxkv.format.layout import PageEntry
from lynxkv.format.reader import PageReader, SectionIndex, read_residual_section
from lynxkv.format.writer import frame_sections
from lynxkv.storage import open_source, read_range, resolve_location


@dataclass(frozen=True)
class Part:
    """One stored cache to join: where its two files are, and their checked headers and indexes."""

    anchor_url: str
    header: AnchorHeader
    anchor_index: SectionIndex
    residual_url: str
    residual_index: SectionIndex  # of the residual file (base 0)


def read_part(anchor_url: str, residual_url: str | None = None, *, allow=(),
              storage_options: dict | None = None) -> Part:
    """A two-file cache's headers and page indexes, checked (CRCs, sizes, the residual bound to the anchor); the
    residual at ``residual_url``, or where the anchor records it under the trust rule (``allow``)."""
    src = open_source(anchor_url, storage_options=storage_options)
    try:
        reader = PageReader(src)
        h, anchor_index = reader.header, reader.index(c.SEGMENT_ANCHOR)
    finally:
        src.close()
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None or seg.placement != c.PLACEMENT_EXTERNAL:
        raise FormatError(f"{anchor_url}: not a two-file cache (no external residual)", field="segments")
    residual_url = residual_url or resolve_location(anchor_url, seg.location, allow=allow)
    rsrc = open_source(residual_url, storage_options=storage_options)
    try:
        _, residual_index = read_residual_section(rsrc, h)
    finally:
        rsrc.close()
    return Part(anchor_url, h, anchor_index, residual_url, residual_index)


def join_problem(before: AnchorHeader, h: AnchorHeader) -> str | None:
    """Why a cache with header ``h`` cannot follow one with header ``before`` in a joined cache, or None."""
    for name in ("layers", "kv_heads", "head_dim", "dtype", "scheme", "fingerprint", "batch_dim"):
        if getattr(h, name) != getattr(before, name):
            return f"its {name} ({getattr(h, name)}) differs from the part before it ({getattr(before, name)})"
    if before.tokens % before.scheme.page:
        return f"the part before it ends inside a page ({before.tokens} tokens, pages of {before.scheme.page})"
    if h.scheme.sink_tokens:
        return f"it starts with {h.scheme.sink_tokens} sink tokens, which only a cache's start may hold"
    return None


class JoinedSegment:
    """Bytes ``[0, size)`` of one joined segment: ``lead`` (its headers and page index, in memory), then byte
    ranges of the parts' objects, in order."""

    def __init__(self, lead: bytes, spans: list[tuple[str, int, int]]):
        self.lead = lead
        merged: list[list] = []
        for url, offset, length in spans:  # a part's consecutive pages of one layer are one read
            if merged and merged[-1][0] == url and merged[-1][1] + merged[-1][2] == offset:
                merged[-1][2] += length
            else:
                merged.append([url, offset, length])
        self.spans = [tuple(s) for s in merged]
        self._starts, pos = [], len(lead)
        for _, _, length in self.spans:
            self._starts.append(pos)
            pos += length
        self.size = pos

    def fetch(self, a: int, b: int, storage_options: dict | None = None) -> bytes:
        """Bytes ``[a, b)`` (ranged reads of every object they cover)."""
        out = [self.lead[a:b]] if a < len(self.lead) else []
        i = max(0, bisect.bisect_right(self._starts, a) - 1)
        while i < len(self.spans) and self._starts[i] < b:
            url, offset, length = self.spans[i]
            lo, hi = max(a, self._starts[i]) - self._starts[i], min(b, self._starts[i] + length) - self._starts[i]
            if hi > lo:
                out.append(read_range(url, offset + lo, offset + hi, storage_options))
            i += 1
        return b"".join(out)


@dataclass(frozen=True)
class JoinedCache:
    header: AnchorHeader  # as a reader parses it from ``anchor``'s first bytes
    anchor: JoinedSegment  # the anchor file
    residual: JoinedSegment  # the residual file


def joined_cache_id(parts: list[Part]) -> bytes:
    """The same parts always join to the same cache id (16 bytes of a hash over the parts' ids)."""
    return hashlib.blake2b(b"".join(p.header.cache_id for p in parts), digest_size=16,
                           person=b"lynxkv-joined").digest()


def join_caches(parts: list[Part], *, prompt_token_ids=(), properties=(), residual_location: str) -> JoinedCache:
    """The parts as one cache (see the module docstring); ``residual_location`` is what its anchor header records
    as the residual's place (e.g. a file name next to a saved copy)."""
    if not parts:
        raise InputError("join_caches: nothing to join")
    first = parts[0].header
    for i, p in enumerate(parts[1:], 1):
        problem = join_problem(parts[i - 1].header, p.header)
        if problem is not None:
            raise InputError(f"part {i} ({p.anchor_url}) cannot be joined: {problem}")
    tokens = sum(p.header.tokens for p in parts)
    pages = first.layers * -(-tokens // first.scheme.page)
    if tokens > c.MAX_TOKENS or pages > c.MAX_PAGE_ENTRIES:
        raise InputError(f"join_caches: {tokens} tokens in {pages} pages exceed what format v1 stores "
                         f"(at most {c.MAX_TOKENS} tokens, {c.MAX_PAGE_ENTRIES} pages per segment)")

    def section(kind: int, lead: int) -> tuple[list[PageEntry], list[tuple[str, int, int]]]:
        entries, spans, pos = [], [], lead
        for layer in range(first.layers):
            for p in parts:
                index = p.anchor_index if kind == c.SEGMENT_ANCHOR else p.residual_index
                url = p.anchor_url if kind == c.SEGMENT_ANCHOR else p.residual_url
                for page in range(index.pages_per_layer):
                    e = index.entry(layer, page)
                    entries.append(replace(e, offset=pos))
                    spans.append((url, index.base + e.offset, e.stored_length))
                    pos += e.stored_length
        return entries, spans

    index_size = pages * c.PAGE_ENTRY_SIZE
    a_entries, a_spans = section(c.SEGMENT_ANCHOR, index_size)
    r_entries, r_spans = section(c.SEGMENT_RESIDUAL, c.RESIDUAL_HEADER_SIZE + index_size)
    fields = replace(first, tokens=tokens, cache_id=joined_cache_id(parts), segments=(),
                     prompt_token_ids=tuple(int(t) for t in prompt_token_ids), names=(),
                     properties=tuple(sorted(dict(properties).items())))
    framed = frame_sections(fields, a_entries, r_entries, residual_location=residual_location)
    return JoinedCache(framed.header, JoinedSegment(framed.anchor_lead, a_spans),
                       JoinedSegment(framed.residual_lead, r_spans))
