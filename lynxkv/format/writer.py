"""Writing ``.lynx`` 1.0: page records -> sections -> the bytes of the files.

:func:`write_files` puts an encoded cache (:class:`EncodedKV`, e.g. :class:`lynxkv.cache.EncodedCache`) into one
or two :class:`PageSink` s as its layers are read: the pages in order after room left for the header and the
page indexes, which go in last (their offsets are fixed-width, so their length is known first). :func:`build_files`
gives the same bytes in memory, as the files' parts in order (never joined on the way to a file). Both are
deterministic given ``cache_id`` (the golden examples of spec/FORMAT.md rely on that). Putting the bytes
anywhere is the storage layer's job (:class:`lynxkv.storage.AtomicWriter` is a sink).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.headers import AnchorHeader, SegmentEntry, names_problem, pack_anchor_header
from lynxkv.format.properties import pack_properties
from lynxkv.format.section_headers import ExactHeader, ResidualHeader, pack_exact_header, pack_residual_header
from lynxkv.format.exact_records import EXACT_ZSTD_LEVEL, encode_exact_layer, predict_layer
from lynxkv.format.layout import (PageEntry, anchor_record_layout, pack_index, page_sinks, page_tokens,
                                  residual_record_layout)
from lynxkv.format.records import choose_codec, encode_layer_records
from lynxkv.quant import EncodedTensor
from lynxkv.quant.scheme import Scheme


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, start + n)`` of one layer, encoded: ``keys`` and ``values`` are the tokens' own
    (:meth:`EncodedTensor.tokens` of the layer's, the sink count that of the tokens in the piece), ``start`` a
    multiple of the page, and ``n`` too unless the piece ends the layer. ``originals``: the input keys and values
    ``[H, n, D]`` of these tokens, for an exact segment."""

    start: int
    keys: EncodedTensor
    values: EncodedTensor
    originals: tuple | None = None


class Pieces:
    """A layer that reaches the writer as consecutive :class:`Piece` s (iterated once, in token order) instead of
    whole: memory then holds the pieces being encoded, not the layer. The bytes written are those of the whole
    layer."""

    def __init__(self, pieces):
        self._pieces = pieces

    def __iter__(self):
        return iter(self._pieces)


class EncodedKV(Protocol):
    """What the writer needs of an encoded cache (:class:`lynxkv.cache.EncodedCache` has it)."""

    scheme: Scheme
    layers: Sequence[tuple[EncodedTensor, EncodedTensor] | Pieces]  # per layer (keys, values), or its pieces
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str
    prompt_token_ids: Sequence[int] | None
    model_fingerprint: str | None
    names: Sequence[str] | None
    batch_dim: bool
    properties: Mapping[str, str] | None  # text key/value pairs recorded in the header

    @property
    def pages_per_layer(self) -> int: ...


@dataclass(frozen=True)
class BuiltFiles:
    """The files of a cache as their parts in order (header and index, then each stored page): a writer puts the
    parts one after the other (:func:`lynxkv.storage.write_atomic` takes the tuple) without joining them."""

    anchor_parts: tuple[bytes, ...]  # the anchor file (with the residual section inline when single_file)
    residual_parts: tuple[bytes, ...] | None  # the residual file, or None for a single file
    header: AnchorHeader
    exact_parts: tuple[bytes, ...] | None = None  # the exact segment's own file, when it has one

    @property
    def exact(self) -> bytes | None:
        return None if self.exact_parts is None else b"".join(self.exact_parts)

    @property
    def anchor(self) -> bytes:
        """The anchor file's bytes, joined."""
        return b"".join(self.anchor_parts)

    @property
    def residual(self) -> bytes | None:
        return None if self.residual_parts is None else b"".join(self.residual_parts)


class PageSink(Protocol):
    """Where :func:`write_files` puts a file's bytes, in order: :class:`lynxkv.storage.AtomicWriter` (a file or an
    object as it is written), or :class:`Parts` (in memory)."""

    def write(self, data) -> None: ...

    def reserve(self, n: int) -> int:
        """Leave ``n`` bytes for later at the current end; return their offset."""
        ...

    def fill(self, offset: int, data) -> None:
        """Put the bytes of a :meth:`reserve` (``len(data)`` of them) in place."""
        ...


class Parts:
    """A :class:`PageSink` that keeps the parts of a file in memory (never joined)."""

    def __init__(self) -> None:
        self.parts: list = []
        self._reserved: dict[int, int] = {}  # offset -> index of its part
        self.size = 0

    def write(self, data) -> None:
        data = data if isinstance(data, bytes) else bytes(data)  # a view into a layer's buffer: its own bytes
        self.parts.append(data)
        self.size += len(data)

    def reserve(self, n: int) -> int:
        at = self.size
        self._reserved[at] = len(self.parts)
        self.write(bytes(n))
        return at

    def fill(self, offset: int, data) -> None:
        i = self._reserved.pop(offset)
        if len(data) != len(self.parts[i]):
            raise ValueError(f"fill: {len(data)} bytes for a reserve of {len(self.parts[i])}")
        self.parts[i] = data

    def chunks(self):
        """The bytes written, in order (what a :class:`ScratchSink` gives back)."""
        return iter(self.parts)

    def close(self) -> None:
        self.parts = []


class ScratchSink(PageSink, Protocol):
    """Where :func:`write_files` keeps a section that goes into the anchor file after the others (a single file's
    residual and exact sections) until it is copied there: :class:`Parts` in memory, or a temporary file
    (:class:`lynxkv.storage.SpillFile`) so that memory does not hold a section of the cache."""

    def chunks(self): ...

    def close(self) -> None: ...


class _Section:
    """The index entries of a section's pages as they are stored; offsets section-relative, from ``lead`` (the
    bytes before the first page inside the section)."""

    def __init__(self, lead: int, zstd: bool, level: int = 3):
        self.entries: list[PageEntry] = []
        self._pos, self._zstd, self._level = lead, zstd, level

    def store(self, raw: bytes, splits: list[int] | None = None) -> bytes:
        """The stored bytes of a page record (zstd only where it makes the page smaller; with ``splits``, zstd
        frames split there: codec 2, exact pages), its entry recorded."""
        codec, data = choose_codec(raw, self._zstd, self._level, splits)
        self.entries.append(PageEntry(self._pos, len(data), len(raw), codec, crc32(data)))
        self._pos += len(data)
        return data


def _check_layer(keys: EncodedTensor, values: EncodedTensor, s: Scheme, sinks: int) -> None:
    if ((keys.axis, keys.sinks, keys.rotated, values.axis, values.sinks, values.rotated)
            != ("token", sinks, s.rotated("key"), s.value_axis, sinks, s.rotated("value"))):
        raise InputError(f"encoded tensors (axes {keys.axis}/{values.axis}, {keys.sinks} sink tokens, rotated "
                         f"{keys.rotated}/{values.rotated}) do not match the scheme ({s.describe()}): quantize "
                         "with lynxkv.quant.quantize(x, scheme, kind)")


def _header_fields(enc: EncodedKV, cache_id: bytes, single_file: bool, residual_location: str) -> AnchorHeader:
    """Every header field but the segment table, checked against what the format stores."""
    if len(cache_id) != 16:
        raise InputError(f"cache_id: expected 16 bytes, got {len(cache_id)}")
    if not single_file and not residual_location:
        raise InputError("residual_location: a two-file cache needs the residual file's location")
    if len(residual_location.encode("utf-8")) > c.MAX_LOCATION:
        raise InputError(f"residual_location: at most {c.MAX_LOCATION} bytes")
    names = tuple(enc.names or ())
    problem = names_problem(names, len(enc.layers))
    if problem is not None:
        raise InputError(f"names: expected {problem}")
    fingerprint = enc.model_fingerprint or ""
    if fingerprint and (len(fingerprint) != c.FINGERPRINT_HEX_LENGTH
                        or any(ch not in "0123456789abcdef" for ch in fingerprint)):
        raise InputError(f"model_fingerprint: expected {c.FINGERPRINT_HEX_LENGTH} lowercase hex digits "
                         f"(lynxkv.hf.models.model_fingerprint), got {fingerprint!r}")
    properties = tuple(sorted((enc.properties or {}).items()))
    pack_properties(properties)  # text keys and values, within the cap (raises InputError)
    prompt = tuple(int(t) for t in (enc.prompt_token_ids or ()))
    if any(not 0 <= t < 2**32 for t in prompt):
        raise InputError("prompt_token_ids: every id must fit in 32 bits")
    layers, heads, dim = len(enc.layers), enc.kv_heads, enc.head_dim
    for name, value, cap in (("layers", layers, c.MAX_LAYERS), ("kv_heads", heads, c.MAX_KV_HEADS),
                             ("head_dim", dim, c.MAX_HEAD_DIM), ("tokens", enc.tokens, c.MAX_TOKENS),
                             ("prompt_token_ids", len(prompt), c.MAX_PROMPT_TOKENS)):
        if not (0 if name in ("tokens", "prompt_token_ids") else 1) <= value <= cap:
            raise InputError(f"{name}: {value} is outside what the format stores (at most {cap})")
    return AnchorHeader(layers, heads, dim, enc.tokens, enc.dtype, enc.scheme, cache_id, (), prompt, fingerprint,
                        names, c.FLAG_BATCH_DIM if enc.batch_dim else 0, properties=properties)


def write_files(enc: EncodedKV, anchor: PageSink, residual: PageSink | None = None, *,
                cache_id: bytes | None = None, zstd: bool = False, residual_location: str = "",
                exact_kv: Sequence[tuple] | None = None, exact: PageSink | None = None,
                exact_location: str = "", scratch: Callable[[], ScratchSink] = Parts) -> AnchorHeader:
    """Write the files of a ``.lynx`` cache into ``anchor`` and ``residual`` (``None``: one file, the residual
    section inline after the anchor's) as the layers are read from ``enc.layers``: each layer's pages are written
    before the next layer is read, so a sequence that quantizes layers as they are read keeps only those it is
    working on (a layer given as :class:`Pieces`: the pieces it is working on). The header and the
    page indexes go last into the space reserved for them at the start: the bytes are those of
    :func:`build_files`. ``residual_location``: the residual file's path relative to the anchor file's
    directory (or a URL), for two files. ``exact_kv``: the original ``(keys, values)`` ``[H, T, D]`` of each
    layer, in the cache's dtype: an exact segment is written too, into ``exact`` (its own file, recorded as
    ``exact_location``) or, when ``exact`` is None, inline after the other sections. The inline sections that follow
    the anchor's are kept in ``scratch()`` sinks until the anchor's pages are written (default: in memory). Returns
    the header as a reader parses it."""
    single_file = residual is None
    cache_id = secrets.token_bytes(16) if cache_id is None else bytes(cache_id)
    fields = _header_fields(enc, cache_id, single_file, residual_location)
    has_exact = exact_kv is not None
    if has_exact and len(exact_kv) != len(enc.layers):
        raise InputError(f"exact_kv: expected {len(enc.layers)} layers of originals, got {len(exact_kv)}")
    if has_exact and exact is not None and not exact_location:
        raise InputError("exact_location: an exact segment in its own file needs that file's location")
    framing = dict(single_file=single_file, residual_location=residual_location,
                   exact_location=exact_location if exact is not None else None)
    scratches = []

    def held():  # an inline section: written after the anchor pages, so held until then
        scratches.append(scratch())
        return scratches[-1]

    try:
        residual_out = held() if single_file else residual
        exact_out = (exact if exact is not None else held()) if has_exact else None  # inline: after everything
        return _write_sections(enc, fields, anchor, residual_out, exact_out, zstd, exact_kv, framing,
                               single_file, exact is None)
    finally:
        for sink in scratches:
            sink.close()


def _write_sections(enc: EncodedKV, fields: AnchorHeader, anchor: PageSink, residual_out, exact_out, zstd: bool,
                    exact_kv, framing: dict, single_file: bool, exact_inline: bool) -> AnchorHeader:
    """The body of :func:`write_files`: every layer's pages, then the leads, then the inline sections."""
    s = enc.scheme
    pages = len(enc.layers) * enc.pages_per_layer
    blank = [PageEntry(0, 0, 0, c.CODEC_NONE, 0)] * pages
    has_exact = exact_out is not None
    lead = frame_sections(fields, blank, blank, blank if has_exact else None, **framing)
    index_size = pages * c.PAGE_ENTRY_SIZE
    a_at, r_at = anchor.reserve(len(lead.anchor_lead)), residual_out.reserve(len(lead.residual_lead))
    e_at = exact_out.reserve(len(lead.exact_lead)) if has_exact else None
    a_sec, r_sec = _Section(index_size, zstd), _Section(c.RESIDUAL_HEADER_SIZE + index_size, zstd)
    e_sec = _Section(c.EXACT_HEADER_SIZE + index_size, True, EXACT_ZSTD_LEVEL)  # the planes always pay for zstd
    sinks = min(s.sink_tokens, enc.tokens)
    for i, layer in enumerate(enc.layers):  # layer-major streaming order
        if isinstance(layer, Pieces):
            pieces, whole = layer, False
        else:
            keys, values = layer
            pieces, whole = (Piece(0, keys, values, exact_kv[i] if has_exact else None),), True
            del keys, values, layer
        at = 0
        for piece in pieces:  # the pages of each piece in turn: a piece is let go before the next is taken
            n = enc.tokens if whole else _piece_tokens(piece, at, enc, i)
            _check_layer(piece.keys, piece.values, s, max(0, min(sinks, at + n) - at))
            records = []
            for a_rec, r_rec in encode_layer_records(piece.keys, piece.values, s, n):
                anchor.write(a_sec.store(a_rec))
                residual_out.write(r_sec.store(r_rec))
                if has_exact:
                    records.append((a_rec, r_rec))
            if has_exact:
                if piece.originals is None:
                    raise InputError(f"exact_kv layer {i}: a piece from token {at} without its originals")
                originals = _originals(piece.originals, enc, i, n)
                # the full code decoded from the records just written, as the reader decodes it (no unpacking)
                predicted = predict_layer(records, s, enc.kv_heads, enc.head_dim, n, originals[0].dtype, first=at)
                records = None
                for e_rec, splits in encode_exact_layer(originals, predicted, s.page, n):
                    exact_out.write(e_sec.store(e_rec, splits))
                del originals, predicted
            at += n
            del piece, records
        if at != enc.tokens:
            raise InputError(f"layer {i}: pieces of {at} tokens in all, the cache has {enc.tokens}")
    framed = frame_sections(fields, a_sec.entries, r_sec.entries, e_sec.entries if has_exact else None, **framing)
    anchor.fill(a_at, framed.anchor_lead)  # offsets are fixed-width: the leads have the reserved lengths
    residual_out.fill(r_at, framed.residual_lead)
    if has_exact:
        exact_out.fill(e_at, framed.exact_lead)
    if single_file:
        for part in residual_out.chunks():
            anchor.write(part)
    if has_exact and exact_inline:
        for part in exact_out.chunks():
            anchor.write(part)
    return framed.header


def _piece_tokens(piece: Piece, at: int, enc: EncodedKV, layer: int) -> int:
    """The tokens of a layer's piece that should start at token ``at`` (checked: its start, its length in whole
    pages unless it ends the layer, its keys' and values' shapes)."""
    n = piece.keys.shape[1]
    page = enc.scheme.page
    want = (enc.kv_heads, n, enc.head_dim)
    if (piece.start != at or tuple(piece.keys.shape) != want or tuple(piece.values.shape) != want
            or at + n > enc.tokens or (n % page and at + n != enc.tokens) or (n == 0 and enc.tokens)):
        raise InputError(f"layer {layer}: a piece of {n} tokens from token {piece.start} (keys "
                         f"{list(piece.keys.shape)}, values {list(piece.values.shape)}) where the next {want[0]} x "
                         f"[whole pages of {page}] x {want[2]} from token {at} of {enc.tokens} were expected")
    return n


def _originals(pair, enc: EncodedKV, layer: int, tokens: int | None = None) -> tuple:
    """A layer's original keys and values (or those of ``tokens`` of its tokens) as ``[H, T, D]`` CPU tensors of
    the cache's dtype (checked)."""
    from lynxkv.quant.remainder import TORCH_DTYPES

    want = (enc.kv_heads, enc.tokens if tokens is None else tokens, enc.head_dim)
    out = []
    for t in pair:
        t = t.detach()
        if t.dim() == 4 and t.shape[0] == 1:
            t = t[0]
        if tuple(t.shape) != want or t.dtype != TORCH_DTYPES[enc.dtype]:
            raise InputError(f"exact_kv layer {layer}: expected {list(want)} {enc.dtype}, got {tuple(t.shape)} "
                             f"{t.dtype}")
        out.append(t.to("cpu"))
    return tuple(out)


def build_files(enc: EncodedKV, *, cache_id: bytes | None = None, single_file: bool = False,
                zstd: bool = False, residual_location: str = "", exact_kv: Sequence[tuple] | None = None,
                exact_location: str = "") -> BuiltFiles:
    """The bytes of a ``.lynx`` cache, in memory (:func:`write_files` into :class:`Parts`). ``residual_location``
    is the residual file's path relative to the anchor file's directory (or a URL); it is ignored for a single
    file. ``exact_kv``: the originals, for an exact segment, inline unless ``exact_location`` names its own
    file (then in ``BuiltFiles.exact_parts``)."""
    anchor, residual = Parts(), None if single_file else Parts()
    exact = Parts() if exact_kv is not None and exact_location else None
    header = write_files(enc, anchor, residual, cache_id=cache_id, zstd=zstd, residual_location=residual_location,
                         exact_kv=exact_kv, exact=exact, exact_location=exact_location)
    return BuiltFiles(tuple(anchor.parts), None if residual is None else tuple(residual.parts), header,
                      None if exact is None else tuple(exact.parts))


def planned_framing(enc: EncodedKV, *, cache_id: bytes, residual_location: str) -> "FramedSections":
    """The leads of the two-file cache that :func:`write_files` writes for ``enc`` without zstd, before a page is
    encoded: every page's CRC is still 0, but the leads' lengths, every offset and length, and so the files' sizes,
    are the final ones (codec 0 stores a record as it is, and a record's size follows from the scheme and the shape,
    spec/FORMAT.md section 6.2), and so is the anchor header's fixed part. What a publisher needs to serve a cache
    while it is written."""
    fields = _header_fields(enc, cache_id, False, residual_location)
    s, heads, dim, tokens = enc.scheme, enc.kv_heads, enc.head_dim, enc.tokens
    pages = len(enc.layers) * enc.pages_per_layer
    a_pos, r_pos = pages * c.PAGE_ENTRY_SIZE, c.RESIDUAL_HEADER_SIZE + pages * c.PAGE_ENTRY_SIZE
    a_entries, r_entries = [], []
    for _ in range(len(enc.layers)):
        for p in range(enc.pages_per_layer):
            n = page_tokens(tokens, s.page, p)
            a_len = anchor_record_layout(s, heads, dim, n, page_sinks(s, tokens, p)).raw_length
            r_len = residual_record_layout(s, heads, dim, n).raw_length
            a_entries.append(PageEntry(a_pos, a_len, a_len, c.CODEC_NONE, 0))
            r_entries.append(PageEntry(r_pos, r_len, r_len, c.CODEC_NONE, 0))
            a_pos, r_pos = a_pos + a_len, r_pos + r_len
    return frame_sections(fields, a_entries, r_entries, residual_location=residual_location)


@dataclass(frozen=True)
class FramedSections:
    anchor_lead: bytes  # the anchor header and the anchor page index: the anchor file up to its first page
    residual_lead: bytes  # the residual header and the residual page index: the section up to its first page
    header: AnchorHeader  # as a reader parses it (header_length filled in)
    exact_lead: bytes = b""  # the exact header and the exact page index


def frame_sections(fields: AnchorHeader, anchor_entries: list[PageEntry], residual_entries: list[PageEntry],
                   exact_entries: list[PageEntry] | None = None, *, single_file: bool = False,
                   residual_location: str = "", exact_location: str | None = None) -> FramedSections:
    """The bytes around the stored pages of a cache: both headers and both page indexes, from the index entries
    (offsets section-relative, as :func:`_section` places them) and ``fields`` (every header field but the segment
    table, which is computed here). The pages themselves are the caller's: written after each lead, in order.
    ``exact_entries``: an exact segment's, external at ``exact_location`` or, when that is None, inline after
    the other inline sections."""
    a_index, r_index = pack_index(anchor_entries), pack_index(residual_entries)
    a_length = len(a_index) + sum(e.stored_length for e in anchor_entries)
    r_length = c.RESIDUAL_HEADER_SIZE + len(r_index) + sum(e.stored_length for e in residual_entries)
    r_head = pack_residual_header(ResidualHeader(fields.cache_id, fields.layers, fields.kv_heads, fields.head_dim,
                                                 fields.tokens, fields.scheme.page, fields.scheme.residual_bits,
                                                 crc32(r_index)))
    e_index = pack_index(exact_entries) if exact_entries is not None else b""
    e_length = c.EXACT_HEADER_SIZE + len(e_index) + sum(e.stored_length for e in exact_entries or ())
    e_head = b"" if exact_entries is None else pack_exact_header(
        ExactHeader(fields.cache_id, fields.layers, fields.kv_heads, fields.head_dim, fields.tokens, fields.scheme.page,
                    fields.dtype, crc32(e_index)))

    def header(anchor_offset: int) -> AnchorHeader:
        anchor_seg = SegmentEntry(c.SEGMENT_ANCHOR, c.PLACEMENT_INLINE, len(anchor_entries), anchor_offset, a_length,
                                  crc32(a_index))
        if single_file:
            res_seg = SegmentEntry(c.SEGMENT_RESIDUAL, c.PLACEMENT_INLINE, len(residual_entries),
                                   anchor_offset + a_length, r_length, crc32(r_index))
        else:
            res_seg = SegmentEntry(c.SEGMENT_RESIDUAL, c.PLACEMENT_EXTERNAL, len(residual_entries), 0, r_length,
                                   crc32(r_index), residual_location)
        segments = (anchor_seg, res_seg)
        if exact_entries is not None:
            if exact_location is None:  # inline: after every other inline section
                end = anchor_offset + a_length + (r_length if single_file else 0)
                segments += (SegmentEntry(c.SEGMENT_EXACT, c.PLACEMENT_INLINE, len(exact_entries), end, e_length,
                                          crc32(e_index)),)
            else:
                segments += (SegmentEntry(c.SEGMENT_EXACT, c.PLACEMENT_EXTERNAL, len(exact_entries), 0, e_length,
                                          crc32(e_index), exact_location),)
        return replace(fields, segments=segments,
                       flags=fields.flags | (c.FLAG_PROPERTIES if fields.properties else 0))

    # The header holds the anchor section's offset, which is the header's own length: pack once to learn it.
    length = len(pack_anchor_header(header(0)))
    h = header(length)
    head = pack_anchor_header(h)
    assert len(head) == length  # offsets are fixed-width, so the length cannot change
    return FramedSections(head + a_index, r_head + r_index, replace(h, header_length=length), e_head + e_index)
