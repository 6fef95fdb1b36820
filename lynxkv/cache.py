"""The high-level cache API: encode KV tensors, save them as ``.lynx``, open a cache and read it back.

    enc  = encode_kv(kv, scheme)                      # kv: per layer (keys, values), each [H, T, D]
    info = save_cache("x.lynx", kv, scheme, zstd=True) # anchor x.lynx + residual x.lynxr (or single_file=True)
    with open_cache("x.lynx") as cache:
        cache.info.tokens, cache.info.bits_per_element
        draft_kv = cache.load_kv(anchor_only=True)    # needs only the anchor file
        full_kv  = cache.load_kv()                    # anchor + residual
        page     = cache.read_anchor_page(layer, p)   # one page, one byte-range read, CRC checked
        findings = cache.verify()                     # [] when every header, index and page checks out

``open_cache`` accepts a path (memory-mapped), a URL, raw bytes or a seekable file object (through
:func:`lynxkv.storage.open_source`); ``residual=`` overrides where the residual is read from (a path, URL, bytes or
file object). Pages are read through the one page reader, :class:`lynxkv.format.reader.PageReader`. Decoding equals
``lynxkv.quant.dequantize(quantize(x))`` bit for bit: the file stores exactly the codes and metadata.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence

import torch

from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.headers import AnchorHeader, decoded_bytes
from lynxkv.format.reader import PageReader, SectionIndex
from lynxkv.format.records import AnchorPage, ResidualPage
from lynxkv.format.verify import Finding, verify_cache
from lynxkv.format.writer import write_files
from lynxkv.kv import DTYPE_NAMES, KVPairs, TORCH_DTYPES, cache_to_kv
from lynxkv.quant import EncodedTensor, dequantize, quantize
from lynxkv.quant.dispatch import concurrent_tensors
from lynxkv.quant.scheme import DEFAULT, Scheme
from lynxkv.storage import (AtomicWriter, exists, has_protocol, open_source, record_location, remove, resolve_location,
                            same_object)


@dataclass
class EncodedCache:
    """A quantized KV cache in memory: what a ``.lynx`` file stores."""

    scheme: Scheme
    layers: list[tuple[EncodedTensor, EncodedTensor]]  # per layer (keys, values)
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str = "fp32"  # the dtype the cache had before encoding: fp32 | fp16 | bf16
    prompt_token_ids: list[int] | None = None
    model_fingerprint: str | None = None
    names: tuple[str, ...] | None = None  # K0, V0, K1, V1, ... as they were in the input file
    batch_dim: bool = False  # the input tensors were [1, H, T, D]
    properties: dict[str, str] | None = None  # text key/value pairs: lynxkv.model, an input file's metadata ...

    @property
    def pages_per_layer(self) -> int:
        return -(-self.tokens // self.scheme.page)

    def dequantize(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None) -> KVPairs:
        out_dtype = dtype or TORCH_DTYPES[self.dtype]
        return [(dequantize(k, self.scheme, anchor_only=anchor_only, dtype=out_dtype),
                 dequantize(v, self.scheme, anchor_only=anchor_only, dtype=out_dtype)) for k, v in self.layers]


def _as_hdt(t: torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.dim() == 4:
        if t.shape[0] != 1:
            raise InputError(f"{what}: a 4-d tensor must be [1, kv_heads, tokens, head_dim], got {tuple(t.shape)}")
        return t[0], True
    if t.dim() != 3:
        raise InputError(f"{what}: expected [kv_heads, tokens, head_dim], got shape {tuple(t.shape)}")
    return t, False


def encode_kv(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], scheme: Scheme = DEFAULT, *,
              prompt_token_ids: Sequence[int] | None = None, model_fingerprint: str | None = None,
              names: Sequence[str] | None = None) -> EncodedCache:
    """Quantize every layer's keys and values (``[H, T, D]`` or ``[1, H, T, D]``, fp32/fp16/bf16), given as
    per-layer pairs or as a ``transformers`` cache (:func:`lynxkv.kv.cache_to_kv`), on their device
    (:func:`lynxkv.quant.quantize`); the codes come back to the CPU for the writer."""
    enc = _encoding(kv, scheme, prompt_token_ids, model_fingerprint, names)
    enc.layers = list(enc.layers)
    return enc


class _QuantizedLayers(Sequence):
    """The layers of a cache quantized when each is read (not kept): what :func:`save_cache` hands the writer, so
    that a few layers' codes are in memory at a time. ``packed``: the codes two per byte where the scheme allows
    (:attr:`lynxkv.quant.EncodedTensor.packed`, the bytes the page records store). Iterating quantizes the next
    layers on the CPU workers, one layer each (:func:`lynxkv.quant.dispatch.concurrent_tensors`), while the caller
    writes the one before them."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], scheme: Scheme, packed: bool):
        self._pairs, self._scheme, self._packed = pairs, scheme, packed

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._layer(self._pairs[i])

    def _layer(self, pair, threads: int | None = None):
        return tuple(quantize(t.detach(), self._scheme, kind, packed=self._packed, threads=threads).to("cpu")
                     for t, kind in zip(pair, ("key", "value")))

    def __iter__(self):
        cpu = all(t.device.type == "cpu" for pair in self._pairs for t in pair)
        workers = min(concurrent_tensors(), len(self)) if cpu else 1
        if workers <= 1:
            yield from (self._layer(pair) for pair in self._pairs)
            return
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(workers, thread_name_prefix="lynxkv-encode")
        try:
            ahead: deque = deque()
            for i in range(len(self)):
                while len(ahead) < workers and i + len(ahead) < len(self):
                    ahead.append(pool.submit(self._layer, self._pairs[i + len(ahead)], 1))
                yield ahead.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _encoding(kv, scheme: Scheme, prompt_token_ids, model_fingerprint, names, *,
              packed: bool = False) -> EncodedCache:
    """An :class:`EncodedCache` of ``kv`` (checked: shapes, dtypes) whose layers are quantized when read."""
    kv = cache_to_kv(kv)  # a transformers DynamicCache, or the pairs as given
    if not len(kv):
        raise InputError("kv: expected at least one layer")
    pairs, shape, batch, dtype = [], None, None, None
    for i, pair in enumerate(kv):
        if len(pair) != 2:
            raise InputError(f"layer {i}: expected a (keys, values) pair")
        for j, t in enumerate(pair):
            what = f"layer {i} {'keys' if j == 0 else 'values'}"
            t3, b = _as_hdt(t, what)
            if t3.dtype not in DTYPE_NAMES:
                raise InputError(f"{what}: dtype {t3.dtype} is not one of fp32, fp16, bf16")
            if shape is None:
                shape, batch, dtype = tuple(t3.shape), b, t3.dtype
            elif tuple(t3.shape) != shape or b != batch or t3.dtype != dtype:
                raise InputError(f"{what}: shape {tuple(t.shape)} {t.dtype} differs from layer 0 keys "
                                 f"({'[1, ' if batch else '['}{', '.join(map(str, shape))}] {dtype})")
        pairs.append((_as_hdt(pair[0], "keys")[0], _as_hdt(pair[1], "values")[0]))
    h, t, d = shape
    return EncodedCache(scheme, _QuantizedLayers(pairs, scheme, packed), h, d, t, DTYPE_NAMES[dtype],
                        list(prompt_token_ids) if prompt_token_ids is not None else None,
                        model_fingerprint or None, tuple(names) if names else None, bool(batch))


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
    properties: dict = field(default_factory=dict)  # text key/value pairs (format 1.1), e.g. lynxkv.model
    format_version: str = ""  # the version the anchor header declares, e.g. "1.3" (keys rotated)

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

    bits = {
        "total": per_el(anchor_bytes + residual_bytes),  # everything: headers, indexes, metadata, codes
        "anchor": per_el(anchor_bytes),  # what a draft needs
        "residual": per_el(residual_bytes),
        "total_codes": float(h.scheme.anchor_bits + h.scheme.residual_bits),  # without metadata
        "anchor_codes": float(h.scheme.anchor_bits),
    }
    return CacheInfo(h.scheme, h.layers, h.kv_heads, h.head_dim, h.dtype, h.tokens, h.pages_per_layer,
                     list(h.prompt_token_ids) if h.prompt_token_ids else None, h.fingerprint or None,
                     h.cache_id.hex(), h.names or None, h.batch_dim,
                     res.location if res and res.placement == c.PLACEMENT_EXTERNAL else None,
                     bool(res and res.placement == c.PLACEMENT_INLINE), anchor_bytes, residual_bytes,
                     index.stored_bytes, res_payload, bits, dict(h.properties), f"{c.VERSION_MAJOR}.{h.version_minor}")


MAX_DECODED_ENV = "LYNXKV_MAX_DECODED_BYTES"


def max_decoded_bytes() -> int:
    """The most decoded bytes one cache may need (``$LYNXKV_MAX_DECODED_BYTES``; default: half the memory)."""
    text = os.environ.get(MAX_DECODED_ENV)
    if text:
        try:
            return int(float(text))
        except ValueError:
            raise InputError(f"${MAX_DECODED_ENV}: expected a number of bytes, got {text!r}") from None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def check_decoded_size(h: AnchorHeader, dtype: torch.dtype, *, anchor_only: bool = False) -> int:
    """Refuse, before anything is allocated, a cache whose declared shape needs more memory to load than
    :func:`max_decoded_bytes`: the output in ``dtype`` plus the codes (1 byte per element per segment) and the
    metadata. Returns the bytes it needs."""
    out = decoded_bytes(h, torch.empty((), dtype=dtype).element_size())
    codes = decoded_bytes(h, 1) * (1 if anchor_only else 2)
    meta = decoded_bytes(h, h.scheme.meta_bytes) * 2 // max(h.scheme.chunk, 1)
    need = out + codes + meta
    limit = max_decoded_bytes()
    if need > limit:
        raise InputError(f"this cache declares {h.layers} layers x {h.kv_heads} heads x {h.tokens} tokens x "
                         f"{h.head_dim} dims: {need:,} bytes to load, more than the limit of {limit:,} bytes "
                         f"(${MAX_DECODED_ENV} raises it)")
    return need


class LynxCache:
    """An open ``.lynx`` cache. Pages are read on demand (one byte-range read each, CRC checked)."""

    def __init__(self, source, *, residual=None, name: str | None = None, allow_locations=()):
        self._src = open_source(source, name)
        self.name = self._src.name
        self._residual_arg = residual
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

    def load_kv(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None) -> KVPairs:
        """Dequantized KV, per layer (keys, values) ``[H, T, D]`` in ``dtype`` (default: the original dtype)."""
        h = self.header
        dtype = dtype or TORCH_DTYPES[h.dtype]
        check_decoded_size(h, dtype, anchor_only=anchor_only)
        if not anchor_only:
            self._residual()
        shape = (h.kv_heads, h.tokens, h.head_dim)
        kv = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(h.layers)]
        self._reader.dequantize_layers(kv, anchor_only=anchor_only)  # page records straight into the tensors
        return kv

    def verify(self) -> list[Finding]:
        """Every finding about both segments (empty when all headers, indexes and page CRCs check out)."""
        opened = []

        def open_residual():
            src = self._open_residual_source()
            if src is not None:
                opened.append(src)
            return src

        try:
            return verify_cache(self._src, open_residual)
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
        if not d.get("prompt_token_ids"):
            d.pop("prompt_token_ids", None)
        return d

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._rsrc is not None:
            self._rsrc.close()
        self._rsrc = None
        close = getattr(self._src, "close", None)
        if close:
            close()

    def __enter__(self) -> "LynxCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_cache(path, *, residual=None, allow_locations=()) -> LynxCache:
    """Open a ``.lynx`` anchor file (path, URL, bytes or file object).

    The residual is read from ``residual`` when given (the caller named it), else from the location the anchor
    header records, under the trust rule of :func:`lynxkv.storage.resolve_location`: a relative location inside
    the anchor's directory, or a place under a prefix of ``allow_locations`` (or ``$LYNXKV_ALLOW_LOCATIONS``)."""
    return LynxCache(path, residual=residual, allow_locations=allow_locations)


def verify_file(path, *, residual=None, allow_locations=()) -> list[Finding]:
    """Findings for a cache that may be too damaged to open: never raises for a bad file (the residual is found
    as :func:`open_cache` finds it)."""
    src = open_source(path)
    opened = []

    def open_residual():
        if residual is not None:
            rsrc = open_source(residual)
        else:
            h = PageReader(src, exact_size=False).header  # verify_cache only asks after this succeeded
            rsrc = open_source(resolve_location(src.name, h.segment(c.SEGMENT_RESIDUAL).location,
                                                allow=allow_locations))
        opened.append(rsrc)
        return rsrc

    try:
        return verify_cache(src, open_residual)
    finally:
        for s in opened + [src]:
            s.close()


def default_residual_path(anchor_path: str | os.PathLike) -> str:
    """``x.lynx`` -> ``x.lynxr``; any other name gets ``.lynxr`` appended."""
    p = Path(anchor_path)
    return str(p.with_suffix(c.RESIDUAL_SUFFIX) if p.suffix == ".lynx" else p.with_name(p.name + c.RESIDUAL_SUFFIX))


def save_cache(path: str | os.PathLike, kv_or_encoded, scheme: Scheme = DEFAULT, *,
               residual_path: str | os.PathLike | None = None, residual_location: str | None = None,
               single_file: bool = False, zstd: bool = False, prompt_token_ids: Sequence[int] | None = None,
               model_fingerprint: str | None = None, names: Sequence[str] | None = None,
               cache_id: bytes | None = None, properties: dict[str, str] | None = None) -> CacheInfo:
    """Encode (unless given an :class:`EncodedCache`) and write a cache atomically; return its info.

    Two files by default: ``path`` (anchor) and ``residual_path`` (default: ``path`` with suffix ``.lynxr``),
    the residual written first so that an anchor file never points at a missing residual. The anchor header
    records the residual as ``residual_location`` (default: its path relative to the anchor's directory; pass a
    URL when the residual will be served from elsewhere). ``properties`` are text key/value pairs recorded in
    the header (the model's name as ``lynxkv.model``, an input file's own metadata).

    Replacing a two-file cache is atomic for readers: if the residual path is taken, the new residual goes to a
    fresh name (``x.<id>.lynxr``), the anchor is renamed over the old one last, and only then is the old
    residual removed; a crash at any point leaves the old cache or the new one, each complete.
    """
    if isinstance(kv_or_encoded, EncodedCache):
        enc = kv_or_encoded
        if prompt_token_ids is not None:
            enc.prompt_token_ids = list(prompt_token_ids)
        if model_fingerprint is not None:
            enc.model_fingerprint = model_fingerprint
        if names is not None:
            enc.names = tuple(names)
    else:  # each layer quantized as the writer reaches it, its codes packed as the records store them
        enc = _encoding(kv_or_encoded, scheme, prompt_token_ids, model_fingerprint, names, packed=True)
    if properties is not None:
        enc.properties = dict(properties)
    path = os.fspath(path)
    if single_file:
        if residual_path is not None:
            raise InputError("residual_path: a single-file cache keeps its residual inside the anchor file")
        old = residual_file_of(path)
        with AtomicWriter(path) as anchor:
            write_files(enc, anchor, cache_id=cache_id, zstd=zstd)
        if old is not None:
            with contextlib.suppress(LynxError):  # the replaced two-file cache's residual, now unreferenced
                remove(old)
        rpath = None
    else:
        rpath = os.fspath(residual_path) if residual_path is not None else default_residual_path(path)
        if same_object(rpath, path):
            raise InputError(f"{path}: the residual path must differ from the anchor path")
        cache_id = secrets.token_bytes(16) if cache_id is None else bytes(cache_id)
        old = residual_file_of(path)
        if residual_location is None and exists(rpath):
            # Replacing a two-file cache: the new residual goes under a fresh name, so that the anchor now in
            # place keeps its own residual until the new anchor replaces it (a reader sees old or new, never a mix).
            rpath = _fresh_residual_name(rpath, cache_id)
        location = residual_location or record_location(path, rpath)
        residual, anchor = AtomicWriter(rpath), None
        try:
            anchor = AtomicWriter(path)
            write_files(enc, anchor, residual, cache_id=cache_id, zstd=zstd, residual_location=location)
            residual.commit()  # first: an anchor never points at a missing residual
            anchor.commit()
        except BaseException:
            for w in (residual, anchor):
                if w is not None:
                    w.abort()
            raise
        orphans = _orphan_residuals(rpath) if residual_path is None else []  # only names this cache's own
        for stale in ([old] if old is not None else []) + orphans:
            if not same_object(stale, rpath):
                with contextlib.suppress(LynxError):  # the old cache's residual (or a crash's), now unreferenced
                    remove(stale)
    with open_cache(path, residual=rpath) as cache:
        return cache.info


def residual_file_of(path: str) -> str | None:
    """The residual file of the two-file cache now at ``path``, if there is one a writer replacing the cache may
    delete afterwards: its recorded location is inside the anchor's directory (the trust rule), a local file."""
    if has_protocol(path) or not os.path.isfile(path):
        return None
    try:
        with open_cache(path) as old:
            loc = old.info.residual_location
            return None if loc is None else resolve_location(old.name, loc)
    except LynxError:
        return None


def _orphan_residuals(rpath: str) -> list[str]:
    """Residuals under fresh names (``x.<8 hex>.lynxr``) beside ``rpath`` that a replacement killed before its
    anchor was renamed left behind; local files only."""
    import re

    if has_protocol(rpath) or not rpath.endswith(c.RESIDUAL_SUFFIX):
        return []
    d, base = os.path.split(os.path.abspath(rpath))
    stem = base[:-len(c.RESIDUAL_SUFFIX)]
    m = re.match(r"^(.*)\.[0-9a-f]{8}$", stem)
    stem = m.group(1) if m else stem
    pattern = re.compile(re.escape(stem) + r"(\.[0-9a-f]{8})?" + re.escape(c.RESIDUAL_SUFFIX) + "$")
    try:
        return [os.path.join(d, n) for n in os.listdir(d) if pattern.match(n)]
    except OSError:
        return []


def _fresh_residual_name(rpath: str, cache_id: bytes) -> str:
    """``x.lynxr`` -> ``x.<8 hex digits of the cache id>.lynxr`` (any other name gets the digits appended)."""
    tag = cache_id.hex()[:8]
    if rpath.endswith(c.RESIDUAL_SUFFIX):
        return f"{rpath[:-len(c.RESIDUAL_SUFFIX)]}.{tag}{c.RESIDUAL_SUFFIX}"
    return f"{rpath}.{tag}"


def save_dump(dump_path, path: str | os.PathLike, scheme: Scheme = DEFAULT, **options) -> CacheInfo:
    """Encode a safetensors KV dump (:mod:`lynxkv.dumps`) into a cache, keeping its tensor names and shapes;
    ``options`` as for :func:`save_cache`."""
    from lynxkv.dumps import kv_names, load_kv_safetensors

    kv, naming = load_kv_safetensors(dump_path)
    if naming.batched:  # keep the [1, H, T, D] shape so that decoding writes it back the same way
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv]
    properties = {**dict(naming.metadata), **(options.pop("properties", None) or {})}  # the file's own metadata
    return save_cache(path, kv, scheme, names=kv_names(len(kv), naming), properties=properties or None, **options)
