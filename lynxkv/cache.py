"""The high-level cache API: encode KV tensors, save them as ``.lynx``, open a cache and read it back.

    enc  = encode_kv(kv, scheme)                      # kv: per layer (keys, values), each [H, T, D]
    info = save_cache("x.lynx", kv, scheme, zstd=True) # anchor x.lynx + residual x.lynxr (or single_file=True)
    with open_cache("x.lynx") as cache:
        cache.info.tokens, cache.info.bits_per_element
        draft_kv = cache.load_kv(anchor_only=True)    # needs only the anchor file
        full_kv  = cache.load_kv()                    # anchor + residual
        page     = cache.read_anchor_page(layer, p)   # one page, one byte-range read, CRC checked
        findings = cache.verify()                     # [] when every header, index and page checks out

``open_cache`` accepts a path (memory-mapped), raw bytes or a seekable file object; ``residual=`` overrides
where the residual is read from (a path, URL, bytes or file object). Decoding equals
``lynxkv.quant.dequantize(quantize(x))`` bit for bit: the file stores exactly the codes and metadata.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.layout import AnchorHeader, anchor_record_layout, residual_record_layout
from lynxkv.format.reader import (
    SectionIndex,
    as_source,
    decode_anchor_page,
    decode_residual_page,
    read_anchor_header,
    read_anchor_index,
    read_page,
    read_residual_section,
    resolve_residual,
)
from lynxkv.format.records import AnchorPage, ResidualPage, check_and_decompress, stack_records, stackable
from lynxkv.format.verify import Finding, verify_cache
from lynxkv.format.writer import build_files, default_residual_path, relative_location, write_atomic
from lynxkv.kv import DTYPE_NAMES, KVPairs, TORCH_DTYPES
from lynxkv.quant import META_TORCH_DTYPE, EncodedTensor, dequantize, quantize
from lynxkv.quant.scheme import DEFAULT, Scheme




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

    @property
    def pages_per_layer(self) -> int:
        return -(-self.tokens // self.scheme.page)

    def decode(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None) -> KVPairs:
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
    """Quantize every layer's keys and values (``[H, T, D]`` or ``[1, H, T, D]``, fp32/fp16/bf16) on their device
    (:func:`lynxkv.quant.quantize`); the codes come back to the CPU for the writer."""
    if not len(kv):
        raise InputError("kv: expected at least one layer")
    layers, shape, batch, dtype = [], None, None, None
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
        k3, _ = _as_hdt(pair[0], "keys")
        v3, _ = _as_hdt(pair[1], "values")
        layers.append((quantize(k3.detach(), scheme).to("cpu"), quantize(v3.detach(), scheme).to("cpu")))
    h, t, d = shape
    return EncodedCache(scheme, layers, h, d, t, DTYPE_NAMES[dtype],
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
                     index.stored_bytes, res_payload, bits)


class LynxCache:
    """An open ``.lynx`` cache. Pages are read on demand (one byte-range read each, CRC checked)."""

    def __init__(self, source, *, residual=None, name: str | None = None):
        self._src = as_source(source, name)
        self.name = getattr(self._src, "name", name)
        self._residual_arg = residual
        self._rsrc = None
        self._rindex: SectionIndex | None = None
        try:
            self.header = read_anchor_header(self._src)
            self.anchor_index = read_anchor_index(self._src, self.header)
        except BaseException:
            self.close()
            raise
        self.info = _info(self.header, self.anchor_index)

    # -- residual --------------------------------------------------------------------------------------------
    def _open_residual_source(self):
        seg = self.header.segment(c.SEGMENT_RESIDUAL)
        if seg is None:
            raise InputError(f"{self.name}: this cache has no residual segment")
        if self._residual_arg is not None:
            return as_source(self._residual_arg)
        if seg.placement == c.PLACEMENT_INLINE:
            return self._src
        loc = resolve_residual(self.name, seg.location)
        if "://" not in loc and not os.path.exists(loc):
            raise InputError(f"residual file {loc} does not exist")
        return as_source(loc)

    def _residual(self):
        if self._rindex is None:
            src = self._open_residual_source()
            try:
                _, index = read_residual_section(src, self.header,
                                                 base=0 if src is not self._src else None)
            except BaseException:
                if src is not self._src:
                    src.close()
                raise
            self._rsrc, self._rindex = src, index
        return self._rsrc, self._rindex

    def residual_reachable(self) -> bool:
        """True when the residual can be opened and its header and index belong to this cache."""
        try:
            self._residual()
            return True
        except LynxError:
            return False

    # -- pages -----------------------------------------------------------------------------------------------
    def read_anchor_page(self, layer: int, page: int) -> AnchorPage:
        stored = read_page(self._src, self.anchor_index, layer, page)
        return decode_anchor_page(stored, self.anchor_index.entry(layer, page), self.header, layer, page)

    def read_residual_page(self, layer: int, page: int) -> ResidualPage:
        src, index = self._residual()
        stored = read_page(src, index, layer, page)
        return decode_residual_page(stored, index.entry(layer, page), self.header, layer, page)

    # -- whole cache -----------------------------------------------------------------------------------------
    def _layer_codes(self, layer: int, *, anchor: bool):
        """(metadata [4, H, ceil(T/C), D] or None, codes [2, H, T, D]) of one layer of one segment: the full
        pages in one vectorised pass (each page's CRC checked first), the short last page on its own."""
        h = self.header
        s, H, D = h.scheme, h.kv_heads, h.head_dim
        src, index = (self._src, self.anchor_index) if anchor else self._residual()
        layout_of = anchor_record_layout if anchor else residual_record_layout
        full = h.tokens // s.page if stackable(layout_of(s, H, D, s.page), s, H, D, anchor=anchor) else 0
        metas, codes = [], []
        if full:
            raws = []
            for p in range(full):
                where = f"{index.name} layer {layer} page {p}"
                raws.append(check_and_decompress(read_page(src, index, layer, p), index.entry(layer, p), where))
            m, k = stack_records(raws, layout_of(s, H, D, s.page), s, H, D, anchor=anchor)
            metas.append(m)
            codes.append(k)
        for p in range(full, h.pages_per_layer):
            if anchor:
                a = self.read_anchor_page(layer, p)
                metas.append(torch.stack([a.key_offset, a.key_scale, a.value_offset, a.value_scale]))
                codes.append(torch.stack([a.key_anchor, a.value_anchor]))
            else:
                r = self.read_residual_page(layer, p)
                codes.append(torch.stack([r.key_residual, r.value_residual]))
        meta_dtype = META_TORCH_DTYPE[s.meta_dtype]
        meta = (torch.cat(metas, dim=2) if metas else torch.empty((4, H, 0, D), dtype=meta_dtype)) if anchor else None
        code = torch.cat(codes, dim=2) if codes else torch.empty((2, H, 0, D), dtype=torch.uint8)
        return meta, code

    def load_encoded(self, *, anchor_only: bool = False) -> EncodedCache:
        """Every page assembled into per-layer :class:`EncodedTensor` (residual zeros when ``anchor_only``)."""
        h = self.header
        layers = []
        for layer in range(h.layers):
            meta, codes = self._layer_codes(layer, anchor=True)
            if anchor_only:
                resid = torch.zeros_like(codes)
            else:
                _, resid = self._layer_codes(layer, anchor=False)
            layers.append((EncodedTensor(codes[0], resid[0], meta[0], meta[1]),
                           EncodedTensor(codes[1], resid[1], meta[2], meta[3])))
        return EncodedCache(h.scheme, layers, h.kv_heads, h.head_dim, h.tokens, h.dtype,
                            list(h.prompt_token_ids) or None, h.fingerprint or None, h.names or None, h.batch_dim)

    def load_kv(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None) -> KVPairs:
        """Dequantized KV, per layer (keys, values) ``[H, T, D]`` in ``dtype`` (default: the original dtype)."""
        return self.load_encoded(anchor_only=anchor_only).decode(anchor_only=anchor_only, dtype=dtype)

    def verify(self) -> list[Finding]:
        """Every finding about both segments (empty when all headers, indexes and page CRCs check out)."""
        opened = []

        def open_residual():
            src = self._open_residual_source()
            if src is not self._src:
                opened.append(src)
            return src

        try:
            return verify_cache(self._src, open_residual)
        finally:
            for src in opened:  # sources opened here; a caller's file object is left open (see FileObjSource)
                src.close()

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._rsrc is not None and self._rsrc is not self._src:
            self._rsrc.close()
        self._rsrc, self._rindex = None, None
        close = getattr(self._src, "close", None)
        if close:
            close()

    def __enter__(self) -> "LynxCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_cache(path, *, residual=None) -> LynxCache:
    """Open a ``.lynx`` anchor file (path, bytes or file object); ``residual`` overrides the residual location."""
    return LynxCache(path, residual=residual)


def verify_file(path, *, residual=None) -> list[Finding]:
    """Findings for a cache that may be too damaged to open: never raises for a bad file."""
    src = as_source(path)
    try:
        def open_residual():
            if residual is not None:
                return as_source(residual)
            h = read_anchor_header(src, exact_size=False)  # verify_cache only asks after this succeeded
            seg = h.segment(c.SEGMENT_RESIDUAL)
            loc = resolve_residual(getattr(src, "name", None), seg.location)
            if "://" not in loc and not os.path.exists(loc):
                raise InputError(f"residual file {loc} does not exist")
            return as_source(loc)

        opened = []

        def open_and_track():
            rsrc = open_residual()
            opened.append(rsrc)
            return rsrc

        return verify_cache(src, open_and_track)
    finally:
        for s in opened + [src]:
            s.close()


def save_cache(path: str | os.PathLike, kv_or_encoded, scheme: Scheme = DEFAULT, *,
               residual_path: str | os.PathLike | None = None, residual_location: str | None = None,
               single_file: bool = False, zstd: bool = False, prompt_token_ids: Sequence[int] | None = None,
               model_fingerprint: str | None = None, names: Sequence[str] | None = None,
               cache_id: bytes | None = None) -> CacheInfo:
    """Encode (unless given an :class:`EncodedCache`) and write a cache atomically; return its info.

    Two files by default: ``path`` (anchor) and ``residual_path`` (default: ``path`` with suffix ``.lynxr``),
    the residual written first so that an anchor file never points at a missing residual. The anchor header
    records the residual as ``residual_location`` (default: its path relative to the anchor's directory; pass a
    URL when the residual will be served from elsewhere).
    """
    if isinstance(kv_or_encoded, EncodedCache):
        enc = kv_or_encoded
        if prompt_token_ids is not None:
            enc.prompt_token_ids = list(prompt_token_ids)
        if model_fingerprint is not None:
            enc.model_fingerprint = model_fingerprint
        if names is not None:
            enc.names = tuple(names)
    else:
        enc = encode_kv(kv_or_encoded, scheme, prompt_token_ids=prompt_token_ids,
                        model_fingerprint=model_fingerprint, names=names)
    path = Path(path)
    if single_file:
        built = build_files(enc, cache_id=cache_id, single_file=True, zstd=zstd)
        write_atomic(path, built.anchor)
    else:
        rpath = Path(residual_path) if residual_path is not None else default_residual_path(path)
        if os.path.abspath(rpath) == os.path.abspath(path):
            raise InputError(f"{path}: the residual path must differ from the anchor path")
        location = residual_location or relative_location(path, rpath)
        built = build_files(enc, cache_id=cache_id, zstd=zstd, residual_location=location)
        write_atomic(rpath, built.residual)
        write_atomic(path, built.anchor)
    with open_cache(path, residual=None if single_file or residual_location is None else
                    (residual_path or default_residual_path(path))) as cache:
        return cache.info
