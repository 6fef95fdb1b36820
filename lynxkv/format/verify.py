"""Checking a ``.lynx`` cache completely: structure, lengths and every checksum of both segments.

:func:`verify_cache` never raises for a bad file: it returns a list of :class:`Finding`, each naming the
segment, the field and, for page problems, the layer and page. It keeps going past a bad page so that one run
reports every damaged page; it stops a segment only where its header or index cannot be trusted. Pages are
checked one at a time and the exactness check rebuilds a few layers at a time: memory does not grow with the cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from lynxkv.errors import FormatError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.headers import inline_end
from lynxkv.format.reader import PageReader


@dataclass(frozen=True)
class Finding:
    segment: str  # "anchor" | "residual" | "exact"
    field: str  # the field or structure that is wrong, e.g. "header_crc32", "page.crc32", "file_length"
    message: str
    layer: int | None = None
    page: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        at = f" (layer {self.layer}, page {self.page})" if self.layer is not None else ""
        return f"{self.segment}{at}: {self.message}"


def _finding(segment: str, exc: LynxError, layer: int | None = None, page: int | None = None) -> Finding:
    field = getattr(exc, "field", None) or type(exc).__name__
    return Finding(segment, field, str(exc), layer, page)


def _pages(reader: PageReader, kind: int) -> list[Finding]:
    found = []
    segment = c.SEGMENT_KINDS[kind]
    index = reader.index(kind)
    for i in range(len(index.entries)):
        layer, page = divmod(i, index.pages_per_layer)
        try:
            reader.page(kind, layer, page)
        except LynxError as exc:
            found.append(_finding(segment, exc, layer, page))
        if page == index.pages_per_layer - 1:  # a mapped file's pages of this layer leave the RSS
            reader.drop_layer(kind, layer)
    return found


def verify_cache(anchor_src, open_residual: Callable[[], object] | None,
                 open_exact: Callable[[], object] | None = None, *, window: int | None = None) -> list[Finding]:
    """All findings for the anchor file in ``anchor_src`` and its residual (``open_residual()`` returns the
    residual's byte source, or raises a LynxError when it cannot be reached; ``None`` skips an external
    residual; an inline residual is always checked). An exact segment is checked likewise through
    ``open_exact``: its header, index and page CRCs, then exactness -- the full code decoded and every page rebuilt
    from it must match the CRC of its original bytes, ``window`` layers at a time (default: one per CPU worker)."""
    found: list[Finding] = []
    try:
        reader = PageReader(anchor_src, exact_size=False)
    except LynxError as exc:
        return [_finding("anchor", exc)]
    h = reader.header
    end = inline_end(h)
    if end != anchor_src.size:
        what = "truncated" if anchor_src.size < end else "trailing bytes"
        found.append(Finding("anchor", "file_length", f"`file_length` of anchor: expected {end} bytes, got "
                             f"{anchor_src.size} ({what})"))
    try:
        reader.index(c.SEGMENT_ANCHOR)
    except LynxError as exc:
        found.append(_finding("anchor", exc))
    else:
        found += _pages(reader, c.SEGMENT_ANCHOR)

    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None or (seg.placement == c.PLACEMENT_EXTERNAL and open_residual is None):
        return found
    try:
        rsrc = None if seg.placement == c.PLACEMENT_INLINE else open_residual()
    except LynxError as exc:
        found.append(Finding("residual", "location", f"residual not reachable: {exc}"))
        return found
    try:
        reader.attach_residual(rsrc)
    except FormatError as exc:
        found.append(_finding("residual", exc))
        return found
    found += _pages(reader, c.SEGMENT_RESIDUAL)
    return found + _exact(reader, open_exact, clean=not found, window=window)


def _exact(reader: PageReader, open_exact, clean: bool, window: int | None) -> list[Finding]:
    """Findings for the exact segment: structure and page CRCs, then (when everything else is clean) exactness."""
    seg = reader.header.segment(c.SEGMENT_EXACT)
    if seg is None or (seg.placement == c.PLACEMENT_EXTERNAL and open_exact is None):
        return []
    try:
        esrc = None if seg.placement == c.PLACEMENT_INLINE else open_exact()
    except LynxError as exc:
        return [Finding("exact", "location", f"exact segment not reachable: {exc}")]
    try:
        reader.attach_exact(esrc)
    except FormatError as exc:
        return [_finding("exact", exc)]
    found = _pages(reader, c.SEGMENT_EXACT)
    if found or not clean:
        return found
    import torch

    from lynxkv.quant.remainder import TORCH_DTYPES

    from lynxkv.quant.dispatch import concurrent_tensors

    h = reader.header
    dtype, shape = TORCH_DTYPES[h.dtype], (h.kv_heads, h.tokens, h.head_dim)
    window = window or concurrent_tensors()  # layers rebuilt at once: memory holds these, not the cache
    try:
        for start in range(0, h.layers, window):
            layers = range(start, min(start + window, h.layers))
            kv = {layer: (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for layer in layers}
            reader.dequantize_layers(kv, layers=layers)
            reader.apply_exact(kv, layers=layers)
            del kv
    except LynxError as exc:
        found.append(_finding("exact", exc))
    return found
