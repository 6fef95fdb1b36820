"""Reading ``.lynx`` 1.0 from a byte source: the one page reader.

:class:`PageReader` walks a cache over byte sources (anything with ``size`` and ``read(offset, length)``, see
:mod:`lynxkv.storage`): ``header``, ``index(segment)``, ``page(segment, layer, page)``, ``pages(segment)`` and
``layer(segment, layer)``. The cache API, ``verify``, ``lynxkv tier`` and the progressive reader all read through
it; a source that streams (the progressive reader's buffers) is told through ``release(offset, reader)`` when the
bytes below an offset are no longer needed.

The steps are also public on their own, so that a transport that only has some bytes in hand can drive them:

1. the header from its bytes: :func:`layout.anchor_header_length` on the first ``PREFIX_SIZE`` bytes, then
   :func:`layout.parse_anchor_header` on ``header_length`` bytes (or :func:`read_anchor_header` on a source);
2. where the pages are: :func:`index_span` says where a section's page index lies, :func:`parse_section_index`
   checks it and returns a :class:`SectionIndex` with absolute byte spans per (layer, page) in streaming order;
3. :func:`decode_page` -- one page record from its stored bytes, CRC-32 checked first.

The first two steps live in :mod:`lynxkv.format.sections` and are importable from here as well.

Reads never go past ``size`` and nothing is allocated from a header's claims before the claims have been checked
against caps and the source size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lynxkv.errors import FormatError
from lynxkv.format import constants as c
from lynxkv.format.headers import AnchorHeader
from lynxkv.format.section_headers import ExactHeader, ResidualHeader
from lynxkv.format.sections import (
    SectionIndex,
    index_span,
    parse_section_index,
    read_anchor_header,
    read_anchor_index,
    read_bytes,
    read_exact_section,
    read_residual_section,
)
from lynxkv.format.exact_records import apply_exact_record
from lynxkv.format.layout import (
    PageEntry,
    anchor_record_layout,
    page_sinks,
    page_tokens,
    residual_record_layout,
)
from lynxkv.quant import META_TORCH_DTYPE
from lynxkv.quant.dispatch import concurrent_tensors
from lynxkv.format.records import (
    AnchorPage,
    ResidualPage,
    anchor_page,
    check_and_decompress,
    decode_anchor_records,
    decode_residual_records,
    dequantize_records,
    join_records,
    residual_page,
)

__all__ = [  # the section readers live in lynxkv.format.sections and are public here as before
    "PageReader", "SectionIndex", "decode_page", "index_span", "parse_section_index", "read_anchor_header",
    "read_anchor_index", "read_exact_section", "read_page", "read_residual_section",
]


# ---------------------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------------------
def _where(segment: str, layer: int, page: int) -> str:
    return f"{segment} layer {layer} page {page}"


def _record_layout(h: AnchorHeader, kind: int, page: int):
    """The record layout of ``page`` (every page of a layer has the same index entry size rule)."""
    n = page_tokens(h.tokens, h.scheme.page, page)
    if kind == c.SEGMENT_ANCHOR:
        return anchor_record_layout(h.scheme, h.kv_heads, h.head_dim, n, page_sinks(h.scheme, h.tokens, page))
    return residual_record_layout(h.scheme, h.kv_heads, h.head_dim, n)


def decode_page(stored, entry: PageEntry, h: AnchorHeader, kind: int, layer: int,
                page: int) -> AnchorPage | ResidualPage:
    """Decode the record of (``layer``, ``page``) of segment ``kind`` from its stored bytes (CRC checked first)."""
    where = _where(c.SEGMENT_KINDS[kind], layer, page)
    raw = check_and_decompress(stored, entry, where)
    if kind == c.SEGMENT_EXACT:  # applied to the full code's decoding (PageReader.apply_exact), not decoded alone
        return raw
    lay = _record_layout(h, kind, page)
    if kind == c.SEGMENT_ANCHOR:
        return anchor_page(*decode_anchor_records([raw], lay, h.scheme, h.kv_heads, h.head_dim, where))
    return residual_page(decode_residual_records([raw], lay, h.scheme, h.kv_heads, h.head_dim, where))


def read_page(src, index: SectionIndex, layer: int, page: int, *, in_place: bool = False) -> bytes:
    """The stored bytes of one page (one byte-range read; ``in_place``: a view where the source has one)."""
    offset, length = index.span(layer, page)
    return read_bytes(src, offset, length, "page", _where(index.name, layer, page), in_place=in_place)


class PageReader:
    """The pages of one cache over byte sources: the anchor file's, and the residual's once attached.

    ``PageReader(anchor_src)`` reads and checks the anchor header (``exact_size``: the file length must be exactly
    header + inline sections). An inline residual is read from the anchor source; an external one from the
    source given to :meth:`attach_residual`, whose header and index must belong to this cache.
    """

    def __init__(self, anchor, *, exact_size: bool = True):
        self.anchor = anchor
        self.header = read_anchor_header(anchor, exact_size=exact_size)
        self.residual_header: ResidualHeader | None = None
        self.exact_header: ExactHeader | None = None
        self._sources = {c.SEGMENT_ANCHOR: anchor}
        self._indexes: dict[int, SectionIndex] = {}

    @property
    def residual_inline(self) -> bool:
        seg = self.header.segment(c.SEGMENT_RESIDUAL)
        return seg is not None and seg.placement == c.PLACEMENT_INLINE

    def attach_residual(self, src=None, *, base: int | None = None) -> SectionIndex:
        """Read the residual header and index from ``src`` (default: the anchor source, for an inline residual);
        ``base`` is where the residual section starts in ``src`` (default: 0 for a source of its own)."""
        if src is None:
            src = self.anchor
        elif base is None:
            base = 0
        self.residual_header, index = read_residual_section(src, self.header, base=base)
        self._sources[c.SEGMENT_RESIDUAL] = src
        self._indexes[c.SEGMENT_RESIDUAL] = index
        return index

    @property
    def exact_inline(self) -> bool:
        seg = self.header.segment(c.SEGMENT_EXACT)
        return seg is not None and seg.placement == c.PLACEMENT_INLINE

    def attach_exact(self, src=None, *, base: int | None = None) -> SectionIndex:
        """Read the exact header and index from ``src`` (default: the anchor source, for an inline exact
        segment); ``base`` as for :meth:`attach_residual`."""
        if src is None:
            src = self.anchor
        elif base is None:
            base = 0
        self.exact_header, index = read_exact_section(src, self.header, base=base)
        self._sources[c.SEGMENT_EXACT] = src
        self._indexes[c.SEGMENT_EXACT] = index
        return index

    def apply_exact(self, out, threads: int | None = None, layers: range | None = None) -> None:
        """Turn ``out`` -- every layer (or those of ``layers``; ``out[layer]`` for each) decoded from the full code
        in the original dtype (:meth:`dequantize_layers`) -- into the original values, in place, page by page from
        the exact segment; each page's original bytes are
        checked against their CRC before the page is written. Pages are read in order and rebuilt on up to
        ``threads`` workers (:func:`lynxkv.quant.dispatch.concurrent_tensors`; at most that many pages held at
        once); an error is that of the first failing page. On an error ``out`` is partly rebuilt: callers return
        nothing then."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        h = self.header
        page = h.scheme.page

        def rebuild(layer: int, p: int, raw) -> None:
            k, v = out[layer]
            sl = slice(p * page, min((p + 1) * page, h.tokens))
            apply_exact_record(raw, k[:, sl], v[:, sl], _where("exact", layer, p), k[:, sl], v[:, sl])

        pages = (self.pages(c.SEGMENT_EXACT, decode=False) if layers is None
                 else self._layer_pages(c.SEGMENT_EXACT, layers))
        workers = concurrent_tensors(threads)
        if workers <= 1:
            for layer, p, _, raw in pages:
                rebuild(layer, p, raw)
            return
        pool, pending = ThreadPoolExecutor(workers, thread_name_prefix="lynxkv-exact"), deque()
        try:
            try:
                for layer, p, _, raw in pages:
                    if len(pending) == workers and pending[0].exception() is not None:
                        break  # the oldest page failed: its error is the first
                    if len(pending) == workers:
                        pending.popleft()
                    pending.append(pool.submit(rebuild, layer, p, raw))
            except BaseException:  # a read error: an earlier page's rebuild error comes first
                for done in pending:
                    if done.exception() is not None:
                        raise done.exception() from None
                raise
            for done in pending:
                done.result()  # in page order
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def source(self, kind: int):
        if kind not in self._sources:
            if kind == c.SEGMENT_EXACT and self.exact_inline:
                self.attach_exact()
            elif kind == c.SEGMENT_RESIDUAL and self.residual_inline:
                self.attach_residual()
            else:
                raise FormatError(f"`segments`: the {c.SEGMENT_KINDS.get(kind, kind)} segment is not attached",
                                  field="segments", where="anchor")
        return self._sources[kind]

    def index(self, kind: int) -> SectionIndex:
        """The page index of segment ``kind`` (read and checked once)."""
        if kind not in self._indexes:
            if kind == c.SEGMENT_ANCHOR:
                self._indexes[kind] = read_anchor_index(self.anchor, self.header)
            else:
                self.source(kind)
        return self._indexes[kind]

    def stored(self, kind: int, layer: int, page: int) -> bytes:
        return read_page(self.source(kind), self.index(kind), layer, page)

    def raw(self, kind: int, layer: int, page: int):
        """The raw record of one page: CRC-32 checked, decompressed (bounded by its raw length)."""
        index = self.index(kind)
        return check_and_decompress(self.stored(kind, layer, page), index.entry(layer, page),
                                    _where(index.name, layer, page))

    def page(self, kind: int, layer: int, page: int) -> AnchorPage | ResidualPage:
        index = self.index(kind)
        return decode_page(self.stored(kind, layer, page), index.entry(layer, page), self.header, kind, layer, page)

    def pages(self, kind: int, *, decode: bool = True) -> Iterator[tuple[int, int, PageEntry, object]]:
        """Every page of segment ``kind`` in file order (layer-major): ``(layer, page, entry, record)``, the CRC
        checked before it is yielded (with ``decode=False`` the record is the raw record: checked and decompressed
        only, for :func:`records.dequantize_records`; of a memory-mapped file, a view of the mapping). A streaming
        source is told after each page that the bytes before its end are no longer needed."""
        src, index = self.source(kind), self.index(kind)
        release = getattr(src, "release", None)
        for i, entry in enumerate(index.entries):
            layer, page = divmod(i, index.pages_per_layer)
            stored = read_page(src, index, layer, page, in_place=True)
            if decode:
                rec = decode_page(stored, entry, self.header, kind, layer, page)
            else:
                rec = check_and_decompress(stored, entry, _where(index.name, layer, page))
            if release is not None:
                release(index.base + entry.offset + entry.stored_length, index.name)
            yield layer, page, entry, rec

    def _layer_pages(self, kind: int, layers: range) -> Iterator[tuple[int, int, PageEntry, object]]:
        """The raw records of the pages of ``layers`` (as :meth:`pages` with ``decode=False``); a mapped file's
        pages of each layer leave the RSS once the next layer is reached."""
        src, index = self.source(kind), self.index(kind)
        for layer in layers:
            for page in range(index.pages_per_layer):
                entry = index.entry(layer, page)
                stored = read_page(src, index, layer, page, in_place=True)
                yield layer, page, entry, check_and_decompress(stored, entry, _where(index.name, layer, page))
            self.drop_layer(kind, layer)

    def layer_records(self, kind: int, layer: int) -> tuple[bytes, list[int]]:
        """The raw records of one layer's pages (each CRC-32 checked, decompressed) in one buffer, and where each
        starts in it. A layer's pages are contiguous in the file: without zstd this is one read (of a local file,
        a view of its mapping, not a copy), and the records are checked in place."""
        src, index = self.source(kind), self.index(kind)
        entries = [index.entry(layer, p) for p in range(index.pages_per_layer)]
        if not entries:
            return b"", []
        at, pos = [], entries[0].offset
        for e in entries:
            if e.offset != pos or e.codec != c.CODEC_NONE:
                break
            at.append(pos - entries[0].offset)
            pos += e.stored_length
        else:
            data = read_bytes(src, index.base + entries[0].offset, pos - entries[0].offset, "page",
                               _where(index.name, layer, 0), in_place=True)
            view = memoryview(data)
            for p, (e, a) in enumerate(zip(entries, at)):
                check_and_decompress(view[a:a + e.stored_length], e, _where(index.name, layer, p))
            return data, at
        return join_records([self.raw(kind, layer, p) for p in range(len(entries))])

    def drop_layer(self, kind: int, layer: int) -> None:
        """Tell a source that can (a mapped file, :meth:`lynxkv.storage.FileSource.drop`) that one layer's pages
        of segment ``kind`` are no longer needed in memory (they stay readable)."""
        src, index = self.source(kind), self.index(kind)
        drop = getattr(src, "drop", None)
        if drop is None or not index.pages_per_layer:
            return
        first = index.entry(layer, 0)
        last = index.entry(layer, index.pages_per_layer - 1)
        drop(index.base + first.offset, last.offset + last.stored_length - first.offset)

    def dequantize_layers(self, out, *, anchor_only: bool = False, threads: int | None = None,
                          layers: range | None = None) -> None:
        """Dequantize every layer (or those of ``layers``) straight from its page records into ``out[layer]`` (keys,
        values; ``[H, T, D]`` each, written in place), from the anchor alone or with the residual
        (:func:`records.dequantize_records`).
        Layers are read, checked and decoded on up to ``threads`` workers at once, one thread each
        (:func:`lynxkv.quant.dispatch.concurrent_tensors`; one for outputs on another device); with one, the next
        layer's records are read while this one is decoded. An error is that of the first failing layer."""
        from concurrent.futures import ThreadPoolExecutor

        h = self.header
        s = h.scheme
        tokens = [(p * s.page, page_tokens(h.tokens, s.page, p)) for p in range(h.pages_per_layer)]
        layers = range(h.layers) if layers is None else layers
        # on another device than the CPU one thread launches every layer's kernels (their first launch compiles
        # them); the read-ahead below still checks the next layer's records meanwhile
        on_cpu = all(t.device.type == "cpu" for layer in layers for t in out[layer])
        workers = min(concurrent_tensors(threads), len(layers)) if on_cpu else 1
        kinds = (c.SEGMENT_ANCHOR,) + (() if anchor_only else (c.SEGMENT_RESIDUAL,))
        for kind in kinds:
            self.index(kind)  # sources and indexes are opened here, once, not by the workers at the same time

        def records(layer: int):
            return (self.layer_records(c.SEGMENT_ANCHOR, layer),
                    None if anchor_only else self.layer_records(c.SEGMENT_RESIDUAL, layer))

        def decode(layer: int, recs, threads: int | None) -> None:
            (anchor, anchor_at), residual = recs
            dequantize_records(anchor, anchor_at, *(residual or (None, None)), tokens, s, h.kv_heads, h.head_dim,
                               out[layer], lambda p: f"layer {layer} page {p}", threads)
            for kind in kinds:  # a mapped file's pages of this layer leave the RSS: the output is what stays
                self.drop_layer(kind, layer)

        if workers <= 1:  # one layer at a time: the next layer's records are read and checked meanwhile
            with ThreadPoolExecutor(1, thread_name_prefix="lynxkv-read") as pool:
                ahead = pool.submit(records, layers[0]) if layers else None
                for i, layer in enumerate(layers):
                    recs = ahead.result()
                    ahead = pool.submit(records, layers[i + 1]) if i + 1 < len(layers) else None
                    decode(layer, recs, threads)
            return
        pool = ThreadPoolExecutor(workers, thread_name_prefix="lynxkv-read")
        try:
            for done in [pool.submit(lambda layer: decode(layer, records(layer), 1), layer)
                         for layer in layers]:
                done.result()  # in layer order: the first failing layer's error
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def layer(self, kind: int, layer: int) -> tuple[list[torch.Tensor] | None, torch.Tensor, torch.Tensor | None]:
        """(metadata -- K offsets, K scales, V offsets, V scales, as :func:`decode_anchor_records` --, or None for
        the residual; codes ``[2, H, T, D]``; the sink tokens' residual codes ``[2, H, S, D]`` or None) of one
        layer: the full pages decoded in one vectorised pass (each page's CRC checked first), the pages that hold
        sink tokens and the short last page on their own."""
        h = self.header
        s, H, D = h.scheme, h.kv_heads, h.head_dim
        full, ppl = h.tokens // s.page, h.pages_per_layer
        anchor = kind == c.SEGMENT_ANCHOR
        decode = decode_anchor_records if anchor else decode_residual_records
        own = {p for p in range(ppl) if anchor and page_sinks(s, h.tokens, p)}  # pages decoded on their own
        own |= set(range(full, ppl))
        groups = [[p] for p in sorted(own)]
        batch = [p for p in range(full) if p not in own]
        if batch:
            groups.append(batch)
        groups.sort()
        parts = [decode([self.raw(kind, layer, p) for p in g], _record_layout(h, kind, g[0]), s, H, D,
                        _where(c.SEGMENT_KINDS[kind], layer, g[0])) for g in groups]
        if anchor:
            held = [p[2] for p in parts if p[2] is not None]
            sinks = torch.cat(held, dim=2) if held else None
            if not parts:
                meta_dtype = META_TORCH_DTYPE[s.meta_dtype]
                value = (H, 0, -(-D // s.chunk)) if s.value_axis == "channel" else (H, 0, D)
                return ([torch.empty((H, 0, D), dtype=meta_dtype)] * 2 + [torch.empty(value, dtype=meta_dtype)] * 2,
                        torch.empty((2, H, 0, D), dtype=torch.uint8), None)
            if len(parts) == 1:  # no short last page: no concatenation copy
                return parts[0]
            meta = [torch.cat([m[j] for m, _, _ in parts], dim=1) for j in range(4)]
            return meta, torch.cat([k for _, k, _ in parts], dim=2), sinks
        if not parts:
            return None, torch.empty((2, H, 0, D), dtype=torch.uint8), None
        return None, parts[0] if len(parts) == 1 else torch.cat(parts, dim=2), None
