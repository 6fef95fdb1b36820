"""An open cache: :class:`LynxCache` reads a ``.lynx`` cache's pages, tensors and description back through the one
page reader (:class:`lynxkv.format.reader.PageReader`), memory bounded by what the header declares."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from lynxkv.cache.budget import (MAX_DECODED_ENV, check_decoded_size, decoded_need, default_window,  # noqa: F401
                                 max_decoded_bytes, window_for_memory)
from lynxkv.cache.encoded import EncodedCache
from lynxkv.cache.kv import KVPairs, TORCH_DTYPES, resolve_device
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.headers import AnchorHeader
from lynxkv.format.reader import PageReader, SectionIndex
from lynxkv.format.records import AnchorPage, ResidualPage
from lynxkv.format.verify import Finding, verify_cache
from lynxkv.quant import EncodedTensor
from lynxkv.quant.scheme import Scheme
from lynxkv.storage import has_protocol, open_source, resolve_location


@dataclass(frozen=True)
class CacheInfo:
    """What ``lynxkv inspect`` shows: shape, scheme, where the segments are and what they cost."""

    scheme: Scheme
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens: int
    pages_per_layer: int
    prompt_token_ids: list[int] | None
    model_fingerprint: str | None
    cache_id: str  # 32 hex digits
    names: tuple[str, ...] | None
    batch_dim: bool
    residual_location: str | None  # as written in the header (None for an inline residual)
    residual_inline: bool
    anchor_bytes: int  # the anchor file without any inline residual: header + index + pages
    residual_bytes: int  # the residual section/file: header + index + pages
    anchor_payload_bytes: int  # stored page bytes (after zstd where used)
    residual_payload_bytes: int
    bits_per_element: dict = field(default_factory=dict)
    properties: dict = field(default_factory=dict)  # text key/value pairs, e.g. lynxkv.model
    format_version: str = ""  # the version the anchor header declares, e.g. "1.0"
    has_exact: bool = False  # 1.4: an exact segment rebuilds the original tensors bit for bit
    exact_location: str | None = None  # as written in the header (None when inline or absent)
    exact_inline: bool = False
    exact_bytes: int = 0  # the exact section/file: header + index + pages

    def to_dict(self) -> dict:
        d = asdict(self)
        d["scheme"] = self.scheme.to_dict()
        d["names"] = list(self.names) if self.names else None
        return d


def _info(h: AnchorHeader, index: SectionIndex) -> CacheInfo:
    res = h.segment(c.SEGMENT_RESIDUAL)
    anchor_bytes = h.header_length + h.segments[0].length
    residual_bytes = res.length if res else 0
    elements = 2 * h.layers * h.kv_heads * h.tokens * h.head_dim
    res_payload = residual_bytes - (c.RESIDUAL_HEADER_SIZE + index.entries.__len__() * c.PAGE_ENTRY_SIZE) if res else 0

    def per_el(nbytes: int) -> float:
        return 8.0 * nbytes / elements if elements else 0.0

    ex = h.segment(c.SEGMENT_EXACT)
    exact_bytes = ex.length if ex else 0
    bits = {
        "total": per_el(anchor_bytes + residual_bytes),  # everything: headers, indexes, metadata, codes
        "anchor": per_el(anchor_bytes),  # what a draft needs
        "residual": per_el(residual_bytes),
        "exact": per_el(exact_bytes),  # 1.4: what the exact tier adds (0 without one)
        "total_codes": float(h.scheme.anchor_bits + h.scheme.residual_bits),  # without metadata
        "anchor_codes": float(h.scheme.anchor_bits),
    }
    return CacheInfo(h.scheme, h.layers, h.kv_heads, h.head_dim, h.dtype, h.tokens, h.pages_per_layer,
                     list(h.prompt_token_ids) if h.prompt_token_ids else None, h.fingerprint or None,
                     h.cache_id.hex(), h.names or None, h.batch_dim,
                     res.location if res and res.placement == c.PLACEMENT_EXTERNAL else None,
                     bool(res and res.placement == c.PLACEMENT_INLINE), anchor_bytes, residual_bytes,
                     index.stored_bytes, res_payload, bits, dict(h.properties), f"{c.VERSION_MAJOR}.{h.version_minor}",
                     ex is not None, ex.location if ex and ex.placement == c.PLACEMENT_EXTERNAL else None,
                     bool(ex and ex.placement == c.PLACEMENT_INLINE), exact_bytes)


class LynxCache:
    """An open ``.lynx`` cache. Pages are read on demand (one byte-range read each, CRC checked)."""

    def __init__(self, source, *, residual=None, name: str | None = None, allow_locations=(), exact=None):
        self._src = open_source(source, name)
        self.name = self._src.name
        self._residual_arg = residual
        self._exact_arg = exact
        self._esrc = None  # an external exact segment's source, once opened
        self._allow = tuple(allow_locations)
        self._rsrc = None  # an external residual's source, once opened
        try:
            self._reader = PageReader(self._src)
            self.header = self._reader.header
            self.anchor_index = self._reader.index(c.SEGMENT_ANCHOR)
        except BaseException:
            self.close()
            raise
        self.info = _info(self.header, self.anchor_index)

    # -- residual --------------------------------------------------------------------------------------------
    def _open_residual_source(self):
        """The residual's byte source: the override, the anchor source itself (inline), or the recorded location
        resolved by the storage layer."""
        seg = self.header.segment(c.SEGMENT_RESIDUAL)
        if seg is None:
            raise InputError(f"{self.name}: this cache has no residual segment")
        if self._residual_arg is not None:
            return open_source(self._residual_arg)
        if seg.placement == c.PLACEMENT_INLINE:
            return None
        return open_source(resolve_location(self.name, seg.location, allow=self._allow))

    def _residual(self) -> SectionIndex:
        if c.SEGMENT_RESIDUAL not in self._reader._indexes:
            src = self._open_residual_source()
            try:
                self._reader.attach_residual(src)
            except BaseException:
                if src is not None:
                    src.close()
                raise
            self._rsrc = src
        return self._reader.index(c.SEGMENT_RESIDUAL)

    # -- exact segment ----------------------------------------------------------------------------------
    def _open_exact_source(self):
        """The exact segment's byte source: the override, the anchor source (inline), or its recorded location
        under the trust rule."""
        seg = self.header.segment(c.SEGMENT_EXACT)
        if seg is None:
            raise InputError(f"{self.name}: this cache has no exact segment (encode it with --exact)")
        if self._exact_arg is not None:
            return open_source(self._exact_arg)
        if seg.placement == c.PLACEMENT_INLINE:
            return None
        return open_source(resolve_location(self.name, seg.location, allow=self._allow))

    def _exact(self) -> SectionIndex:
        if c.SEGMENT_EXACT not in self._reader._indexes:
            src = self._open_exact_source()
            try:
                self._reader.attach_exact(src)
            except BaseException:
                if src is not None:
                    src.close()
                raise
            self._esrc = src
        return self._reader.index(c.SEGMENT_EXACT)

    def exact_reachable(self) -> bool:
        """True when the exact segment can be opened and its header and index belong to this cache."""
        try:
            self._exact()
            return True
        except LynxError:
            return False

    def residual_reachable(self) -> bool:
        """True when the residual can be opened and its header and index belong to this cache."""
        try:
            self._residual()
            return True
        except LynxError:
            return False

    # -- pages -----------------------------------------------------------------------------------------------
    def read_anchor_page(self, layer: int, page: int) -> AnchorPage:
        return self._reader.page(c.SEGMENT_ANCHOR, layer, page)

    def read_residual_page(self, layer: int, page: int) -> ResidualPage:
        self._residual()
        return self._reader.page(c.SEGMENT_RESIDUAL, layer, page)

    # -- whole cache -----------------------------------------------------------------------------------------
    def load_encoded(self, *, anchor_only: bool = False) -> EncodedCache:
        """Every page assembled into per-layer :class:`EncodedTensor` (residual zeros when ``anchor_only``)."""
        h = self.header
        check_decoded_size(h, torch.uint8, anchor_only=anchor_only)
        if not anchor_only:
            self._residual()
        layers = []
        for layer in range(h.layers):
            meta, codes, sinks = self._reader.layer(c.SEGMENT_ANCHOR, layer)
            if anchor_only:
                resid = torch.zeros_like(codes)
                if sinks is not None:  # the anchor carries the sink tokens' residual
                    resid[:, :, :sinks.shape[2]] = sinks
            else:
                resid = self._reader.layer(c.SEGMENT_RESIDUAL, layer)[1]
            n = min(h.scheme.sink_tokens, h.tokens)
            layers.append(tuple(EncodedTensor(codes[j], resid[j], meta[2 * j], meta[2 * j + 1], h.scheme.axis(kind), n,
                                              h.scheme.rotated(kind)) for j, kind in enumerate(("key", "value"))))
        return EncodedCache(h.scheme, layers, h.kv_heads, h.head_dim, h.tokens, h.dtype,
                            list(h.prompt_token_ids) or None, h.fingerprint or None, h.names or None, h.batch_dim,
                            dict(h.properties) or None)

    def load_kv(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None,
                exact: bool = False, device=None) -> KVPairs:
        """Dequantized KV, per layer (keys, values) ``[H, T, D]`` in ``dtype`` (default: the original dtype) on
        ``device`` (default the CPU; ``"cuda"``, ``"cuda:1"``, a ``torch.device``; ``meta``, an unknown name or a
        missing device is an :class:`InputError`). The tensors are allocated on ``device`` and decoded there:
        only the packed page records cross to it (:func:`lynxkv.quant.dequantize_pages`: the Triton kernels on
        CUDA, the compiled kernels on the CPU, the torch reference elsewhere). ``exact``: the original
        tensors bit for bit, from the full code and the exact segment (in the original dtype only); every page is
        checked against the CRC of its original bytes before anything is returned. The exact segment's coder runs
        on the CPU: with another device the rebuilt tensors are moved there at the end."""
        h = self.header
        dev = resolve_device(device)
        dtype = self._prepare_load(anchor_only, dtype, exact, None)
        shape = (h.kv_heads, h.tokens, h.head_dim)
        where = torch.device("cpu") if exact else dev
        kv = [(torch.empty(shape, dtype=dtype, device=where), torch.empty(shape, dtype=dtype, device=where))
              for _ in range(h.layers)]
        self._reader.dequantize_layers(kv, anchor_only=anchor_only)  # page records straight into the tensors
        if exact:
            self._reader.apply_exact(kv)
            if dev.type != "cpu":
                kv = [(k.to(dev), v.to(dev)) for k, v in kv]
        return kv

    def iter_layers(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None, exact: bool = False,
                    window: int | None = None, recycle: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`load_kv`'s layers one at a time, in order: each ``(keys, values)`` ``[H, T, D]`` holds the same
        values ``load_kv`` gives for that layer, bit for bit. At most ``window`` layers are held at once (default
        :func:`default_window`; at least 1): while the caller has one group of layers, the next group is decoded
        (groups of half the window), so memory holds a few layers, not the cache; the size check
        (:func:`check_decoded_size`) counts the window (:meth:`layer_bytes` each). Segments are opened and checked
        here, before the first layer is decoded; a page that fails its CRC raises when its layer is reached.
        ``recycle``: a layer's tensors are decoded into again for a later layer once the caller asks for the next
        layer, for a caller done with each layer by then (one that writes it out): no fresh memory to fault in
        per layer."""
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise InputError(f"window: expected a number of layers of at least 1, got {window!r}")
        window = window or default_window()
        dtype = self._prepare_load(anchor_only, dtype, exact, window)
        return self._windows(anchor_only, dtype, exact, window, recycle)

    def layer_bytes(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None) -> int:
        """The memory one layer takes to decode (:func:`decoded_need`): what a window of :meth:`iter_layers`
        holds per layer."""
        return decoded_need(self.header, dtype or TORCH_DTYPES[self.header.dtype], anchor_only=anchor_only, layers=1)

    def _windows(self, anchor_only: bool, dtype: torch.dtype, exact: bool, window: int, recycle: bool):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        h = self.header
        shape = (h.kv_heads, h.tokens, h.head_dim)
        group = max(1, window // 2)
        done: deque = deque()  # recycle: the tensors of layers the caller is done with, decoded into again

        def tensors() -> tuple[torch.Tensor, torch.Tensor]:
            if done:
                return done.popleft()
            return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)

        def decode(start: int) -> dict:
            layers = range(start, min(start + group, h.layers))
            out = {layer: tensors() for layer in layers}
            self._reader.dequantize_layers(out, anchor_only=anchor_only, layers=layers)
            if exact:
                self._reader.apply_exact(out, layers=layers)
            return out

        if window == 1:  # nothing decoded ahead
            for start in range(h.layers):
                pair = decode(start).pop(start)
                yield pair
                if recycle:  # the caller asks for the next layer: it is done with this one
                    done.append(pair)
                del pair
            return
        # the next group is decoded while the caller writes this one (the disk and the cores both busy)
        with ThreadPoolExecutor(1, thread_name_prefix="lynxkv-decode") as pool:
            ahead = pool.submit(decode, 0)
            for start in range(0, h.layers, group):
                out = ahead.result()
                ahead = pool.submit(decode, start + group) if start + group < h.layers else None
                for layer in sorted(out):
                    pair = out.pop(layer)  # let go of each layer once the caller has it
                    yield pair
                    if recycle:
                        done.append(pair)
                    del pair
                del out

    def _prepare_load(self, anchor_only: bool, dtype: torch.dtype | None, exact: bool, layers: int | None):
        """The output dtype of a load, after the checks that come before anything is decoded (the options, the
        size, the segments it needs opened)."""
        h = self.header
        if exact and (anchor_only or (dtype is not None and dtype != TORCH_DTYPES[h.dtype])):
            raise InputError(f"exact: the exact segment rebuilds the full cache in its original dtype ({h.dtype}); "
                             "it excludes anchor_only and another dtype")
        dtype = dtype or TORCH_DTYPES[h.dtype]
        check_decoded_size(h, dtype, anchor_only=anchor_only, layers=layers)
        if not anchor_only:
            self._residual()
        if exact:
            self._exact()  # opened and checked before any decoding
        return dtype

    def verify(self, *, window: int | None = None) -> list[Finding]:
        """Every finding about both segments (empty when all headers, indexes and page CRCs check out)."""
        opened = []

        def open_residual():
            src = self._open_residual_source()
            if src is not None:
                opened.append(src)
            return src

        def open_exact():
            src = self._open_exact_source()
            if src is not None:
                opened.append(src)
            return src

        try:
            return verify_cache(self._src, open_residual, open_exact, window=window)
        finally:
            for src in opened:  # sources opened here; a caller's file object is left open (see FileObjSource)
                src.close()

    def describe(self, *, check_residual: bool | None = None) -> dict:
        """What ``lynxkv inspect --json`` prints (stable keys: tokens, layers, kv_heads, head_dim, scheme,
        bits_per_element.total / .anchor, prompt_token_ids when stored).

        ``residual_reachable`` is checked (the residual opened, its header and index read) with
        ``check_residual``; by default only where that reads nothing but a local file the trust rule lets the
        cache follow without asking (inline, or relative inside the anchor's directory), else it is ``None``."""
        d = self.info.to_dict()
        d["scheme_description"] = self.info.scheme.describe()
        if check_residual is None:
            loc = self.info.residual_location
            check_residual = (self._residual_arg is None
                              and (loc is None or not has_protocol(loc) and not loc.startswith("/")
                                   and not self.name.startswith("<") and not has_protocol(self.name)))
        d["residual_reachable"] = self.residual_reachable() if check_residual else None
        if self.info.has_exact:
            loc = self.info.exact_location
            local = (self._exact_arg is None and (loc is None or not has_protocol(loc) and not loc.startswith("/")
                                                  and not self.name.startswith("<") and not has_protocol(self.name)))
            d["exact_reachable"] = self.exact_reachable() if (check_residual or local) else None
        if not d.get("prompt_token_ids"):
            d.pop("prompt_token_ids", None)
        return d

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        for src in (self._rsrc, self._esrc):
            if src is not None:
                src.close()
        self._rsrc = self._esrc = None
        close = getattr(self._src, "close", None)
        if close:
            close()

    def __enter__(self) -> "LynxCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_cache(path, *, residual=None, allow_locations=(), exact=None) -> LynxCache:
    """Open a ``.lynx`` anchor file (path, URL, bytes or file object).

    The residual is read from ``residual`` when given (the caller named it), else from the location the anchor
    header records, under the trust rule of :func:`lynxkv.storage.resolve_location`: a relative location inside
    the anchor's directory, or a place under a prefix of ``allow_locations`` (or ``$LYNXKV_ALLOW_LOCATIONS``).
    ``exact`` names the exact segment's file likewise; by default its recorded location is followed under the
    same rule, and only when it is asked for (``load_kv(exact=True)``, ``verify``)."""
    return LynxCache(path, residual=residual, allow_locations=allow_locations, exact=exact)


def verify_file(path, *, residual=None, allow_locations=(), exact=None, window: int | None = None,
                memory: int | None = None) -> list[Finding]:
    """Findings for a cache that may be too damaged to open: never raises for a bad file (the residual is found
    as :func:`open_cache` finds it). Pages are checked one at a time; an exact segment's check rebuilds ``window``
    layers at a time (:func:`lynxkv.format.verify.verify_cache`), or as many as fit in ``memory`` bytes
    (:func:`window_for_memory`; a bound below one layer raises :class:`InputError`)."""
    src = open_source(path)
    opened = []
    if memory is not None:  # the window fits the bound; a header too damaged to read is verify_cache's to report
        try:
            h = PageReader(src, exact_size=False).header
        except LynxError:
            h = None
        if h is not None:
            window = window_for_memory(memory, decoded_need(h, TORCH_DTYPES[h.dtype], layers=1))

    def open_residual():
        if residual is not None:
            rsrc = open_source(residual)
        else:
            h = PageReader(src, exact_size=False).header  # verify_cache only asks after this succeeded
            rsrc = open_source(resolve_location(src.name, h.segment(c.SEGMENT_RESIDUAL).location,
                                                allow=allow_locations))
        opened.append(rsrc)
        return rsrc

    def open_exact():
        if exact is not None:
            esrc = open_source(exact)
        else:
            h = PageReader(src, exact_size=False).header
            esrc = open_source(resolve_location(src.name, h.segment(c.SEGMENT_EXACT).location, allow=allow_locations))
        opened.append(esrc)
        return esrc

    try:
        return verify_cache(src, open_residual, open_exact, window=window)
    finally:
        for s in opened + [src]:
            s.close()
