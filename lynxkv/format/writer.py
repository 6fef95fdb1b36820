"""Writing ``.lynx`` v1: page records -> sections -> the bytes of the files.

:func:`build_files` turns an encoded cache (:class:`EncodedKV`, e.g. :class:`lynxkv.cache.EncodedCache`) into the
exact bytes of the anchor file and (unless ``single_file``) the residual file, as their parts in order (never
joined on the way to a file); it is deterministic given ``cache_id`` (the golden examples of spec/FORMAT.md rely
on that). Putting the bytes anywhere is the storage layer's job (:func:`lynxkv.storage.write_atomic`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.layout import (
    AnchorHeader,
    PageEntry,
    ResidualHeader,
    SegmentEntry,
    crc32,
    names_problem,
    pack_anchor_header,
    pack_index,
    pack_properties,
    pack_residual_header,
)
from lynxkv.format.records import choose_codec, encode_anchor_record, encode_residual_record
from lynxkv.quant import EncodedTensor
from lynxkv.quant.scheme import Scheme


class EncodedKV(Protocol):
    """What the writer needs of an encoded cache (:class:`lynxkv.cache.EncodedCache` has it)."""

    scheme: Scheme
    layers: Sequence[tuple[EncodedTensor, EncodedTensor]]  # per layer (keys, values)
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str
    prompt_token_ids: Sequence[int] | None
    model_fingerprint: str | None
    names: Sequence[str] | None
    batch_dim: bool
    properties: Mapping[str, str] | None  # text key/value pairs recorded in the header (format 1.1)

    @property
    def pages_per_layer(self) -> int: ...


@dataclass(frozen=True)
class BuiltFiles:
    """The files of a cache as their parts in order (header and index, then each stored page): a writer puts the
    parts one after the other (:func:`lynxkv.storage.write_atomic` takes the tuple) without joining them."""

    anchor_parts: tuple[bytes, ...]  # the anchor file (with the residual section inline when single_file)
    residual_parts: tuple[bytes, ...] | None  # the residual file, or None for a single file
    header: AnchorHeader

    @property
    def anchor(self) -> bytes:
        """The anchor file's bytes, joined."""
        return b"".join(self.anchor_parts)

    @property
    def residual(self) -> bytes | None:
        return None if self.residual_parts is None else b"".join(self.residual_parts)


def _section(records: list[bytes], lead: int, zstd: bool) -> tuple[list[PageEntry], list[bytes]]:
    """Index entries and stored payloads; ``lead`` = bytes before the first page inside the section."""
    entries, stored = [], []
    pos = lead
    for raw in records:
        codec, data = choose_codec(raw, zstd)
        entries.append(PageEntry(pos, len(data), len(raw), codec, crc32(data)))
        stored.append(data)
        pos += len(data)
    return entries, stored


def _page_records(enc: EncodedKV) -> tuple[list[bytes], list[bytes]]:
    s = enc.scheme
    anchors, residuals = [], []
    sinks = min(s.sink_tokens, enc.tokens)
    for keys, values in enc.layers:  # layer-major streaming order
        if ((keys.axis, keys.sinks, keys.rotated, values.axis, values.sinks, values.rotated)
                != ("token", sinks, s.rotated("key"), s.value_axis, sinks, s.rotated("value"))):
            raise InputError(f"encoded tensors (axes {keys.axis}/{values.axis}, {keys.sinks} sink tokens, rotated "
                             f"{keys.rotated}/{values.rotated}) do not match the scheme ({s.describe()}): quantize "
                             "with lynxkv.quant.quantize(x, scheme, kind)")
        for p in range(enc.pages_per_layer):
            start, stop = p * s.page, min((p + 1) * s.page, enc.tokens)
            k, v = keys.tokens(start, stop, s.chunk), values.tokens(start, stop, s.chunk)
            anchors.append(encode_anchor_record(k, v, s))
            residuals.append(encode_residual_record(k, v, s))
    return anchors, residuals


def build_files(enc: EncodedKV, *, cache_id: bytes | None = None, single_file: bool = False,
                zstd: bool = False, residual_location: str = "") -> BuiltFiles:
    """The bytes of a ``.lynx`` cache. ``residual_location`` is the residual file's path relative to the anchor
    file's directory (or a URL); it is ignored for a single file."""
    cache_id = secrets.token_bytes(16) if cache_id is None else bytes(cache_id)
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
            raise InputError(f"{name}: {value} is outside what format v1 stores (at most {cap})")

    anchor_records, residual_records = _page_records(enc)
    index_size = len(anchor_records) * c.PAGE_ENTRY_SIZE
    a_entries, a_stored = _section(anchor_records, index_size, zstd)
    r_entries, r_stored = _section(residual_records, c.RESIDUAL_HEADER_SIZE + index_size, zstd)
    fields = AnchorHeader(layers, heads, dim, enc.tokens, enc.dtype, enc.scheme, cache_id, (), prompt, fingerprint,
                          names, c.FLAG_BATCH_DIM if enc.batch_dim else 0, properties=properties)
    framed = frame_sections(fields, a_entries, r_entries, single_file=single_file,
                            residual_location=residual_location)
    residual = (framed.residual_lead, *r_stored)
    anchor = (framed.anchor_lead, *a_stored, *(residual if single_file else ()))
    return BuiltFiles(anchor, None if single_file else residual, framed.header)


@dataclass(frozen=True)
class FramedSections:
    anchor_lead: bytes  # the anchor header and the anchor page index: the anchor file up to its first page
    residual_lead: bytes  # the residual header and the residual page index: the section up to its first page
    header: AnchorHeader  # as a reader parses it (header_length filled in)


def frame_sections(fields: AnchorHeader, anchor_entries: list[PageEntry], residual_entries: list[PageEntry], *,
                   single_file: bool = False, residual_location: str = "") -> FramedSections:
    """The bytes around the stored pages of a cache: both headers and both page indexes, from the index entries
    (offsets section-relative, as :func:`_section` places them) and ``fields`` (every header field but the segment
    table, which is computed here). The pages themselves are the caller's: written after each lead, in order."""
    a_index, r_index = pack_index(anchor_entries), pack_index(residual_entries)
    a_length = len(a_index) + sum(e.stored_length for e in anchor_entries)
    r_length = c.RESIDUAL_HEADER_SIZE + len(r_index) + sum(e.stored_length for e in residual_entries)
    r_head = pack_residual_header(ResidualHeader(fields.cache_id, fields.layers, fields.kv_heads, fields.head_dim,
                                                 fields.tokens, fields.scheme.page, fields.scheme.residual_bits,
                                                 crc32(r_index)))

    def header(anchor_offset: int) -> AnchorHeader:
        anchor_seg = SegmentEntry(c.SEGMENT_ANCHOR, c.PLACEMENT_INLINE, len(anchor_entries), anchor_offset, a_length,
                                  crc32(a_index))
        if single_file:
            res_seg = SegmentEntry(c.SEGMENT_RESIDUAL, c.PLACEMENT_INLINE, len(residual_entries),
                                   anchor_offset + a_length, r_length, crc32(r_index))
        else:
            res_seg = SegmentEntry(c.SEGMENT_RESIDUAL, c.PLACEMENT_EXTERNAL, len(residual_entries), 0, r_length,
                                   crc32(r_index), residual_location)
        return replace(fields, segments=(anchor_seg, res_seg),
                       flags=fields.flags | (c.FLAG_PROPERTIES if fields.properties else 0),
                       version_minor=1 if fields.properties else c.VERSION_MINOR)

    # The header holds the anchor section's offset, which is the header's own length: pack once to learn it.
    length = len(pack_anchor_header(header(0)))
    h = header(length)
    head = pack_anchor_header(h)
    assert len(head) == length  # offsets are fixed-width, so the length cannot change
    return FramedSections(head + a_index, r_head + r_index, replace(h, header_length=length))
