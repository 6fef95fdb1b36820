"""The anchor header of ``.lynx`` 1.0 (with its segment table), a frozen dataclass <-> bytes, with the structural
checks of spec/FORMAT.md, and the sizes it declares; the residual and exact headers are in
:mod:`lynxkv.format.section_headers`, the properties string in :mod:`lynxkv.format.properties`.

Parsing validates in spec order, bounded, before anything is allocated (magic -> version -> flags -> header
length <= cap -> header CRC -> reserved fields -> counts <= caps -> strings); every error is a
:class:`FormatError` (or :class:`ChecksumError`) whose message names the field, where it sits, what was expected
and what was found. No torch, no file I/O, no policy.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from lynxkv.errors import FormatError, SchemeError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.layout import anchor_record_layout, page_sinks, page_tokens, residual_record_layout
from lynxkv.format.layout import field_error as _err
from lynxkv.format.properties import pack_properties, parse_properties
from lynxkv.quant.scheme import Scheme

_ANCHOR_FIXED = struct.Struct(c.ANCHOR_FIXED_STRUCT)
_SEGMENT = struct.Struct(c.SEGMENT_STRUCT)
assert _ANCHOR_FIXED.size == c.ANCHOR_FIXED_SIZE and _SEGMENT.size == c.SEGMENT_SIZE  # the tables add up

#: Bytes a reader needs to learn ``header_length`` (magic, version, flags, header_length).
PREFIX_SIZE = 8 + 2 + 2 + 4 + 4


def _inv(d: dict) -> dict:
    return {v: k for k, v in d.items()}


@dataclass(frozen=True)
class SegmentEntry:
    """One row of the anchor header's segment table."""

    kind: int  # SEGMENT_ANCHOR | SEGMENT_RESIDUAL | SEGMENT_EXACT
    placement: int  # PLACEMENT_INLINE | PLACEMENT_EXTERNAL
    page_count: int
    offset: int  # inline: byte offset of the section in the anchor file; external: 0
    length: int  # bytes of the section
    index_crc32: int
    location: str = ""  # external: path relative to the anchor file's directory, or a URL


@dataclass(frozen=True)
class AnchorHeader:
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str  # original dtype of the cache: fp32 | fp16 | bf16
    scheme: Scheme
    cache_id: bytes
    segments: tuple[SegmentEntry, ...]
    prompt_token_ids: tuple[int, ...] = ()
    fingerprint: str = ""
    names: tuple[str, ...] = ()  # empty, or 2*layers tensor names: K0, V0, K1, V1, ...
    flags: int = 0
    version_minor: int = c.VERSION_MINOR
    header_length: int = 0  # filled in by the parser (the writer computes it)
    properties: tuple[tuple[str, str], ...] = ()  # text key/value pairs, sorted by key (e.g. lynxkv.model)

    @property
    def pages_per_layer(self) -> int:
        return -(-self.tokens // self.scheme.page)

    @property
    def batch_dim(self) -> bool:
        return bool(self.flags & c.FLAG_BATCH_DIM)

    def segment(self, kind: int) -> SegmentEntry | None:
        for s in self.segments:
            if s.kind == kind:
                return s
        return None


# ---------------------------------------------------------------------------------------------------------
# anchor header
# ---------------------------------------------------------------------------------------------------------
def names_problem(names, layers: int) -> str | None:
    """Why ``names`` cannot be a cache's tensor names (writer and reader apply the same rule), or None: 0 or
    2·layers names, each non-empty, without a newline, not ``__metadata__`` (safetensors' reserved key), all
    different."""
    if not names:
        return None
    if len(names) != 2 * layers:
        return f"0 or {2 * layers} names (2 per layer), got {len(names)}"
    for n in names:
        if not n or "\n" in n or n == "__metadata__":
            return f"non-empty names without newlines, other than __metadata__, got {n!r}"
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        return f"different names, got {dup!r} twice"
    return None


def _pad_to(n: int, align: int) -> int:
    return -(-n // align) * align


def pack_anchor_header(h: AnchorHeader) -> bytes:
    """The header bytes, CRC included; ``h.header_length`` is ignored (computed here)."""
    s = h.scheme
    locations = [seg.location.encode("utf-8") for seg in h.segments]
    fingerprint = h.fingerprint.encode("ascii")
    names = "\n".join(h.names).encode("utf-8")
    properties = pack_properties(h.properties)
    flags = (h.flags | c.FLAG_PROPERTIES) if properties else (h.flags & ~c.FLAG_PROPERTIES)
    flags = (flags | c.FLAG_KEY_ROTATION) if s.rotated("key") else (flags & ~c.FLAG_KEY_ROTATION)
    ranged = s.extremes == "range"
    flags = (flags | c.FLAG_EXTREMES) if ranged else (flags & ~c.FLAG_EXTREMES)
    var = b"".join(
        _SEGMENT.pack(seg.kind, seg.placement, len(loc), seg.page_count, seg.offset, seg.length,
                      seg.index_crc32, 0)
        for seg, loc in zip(h.segments, locations)
    )
    var += struct.pack(f"<{len(h.prompt_token_ids)}I", *h.prompt_token_ids)
    var += b"".join(locations) + fingerprint + names + properties
    length = _pad_to(c.ANCHOR_FIXED_SIZE + len(var) + c.CRC_SIZE, c.HEADER_ALIGN)
    fixed = _ANCHOR_FIXED.pack(
        c.ANCHOR_MAGIC, c.VERSION_MAJOR, h.version_minor, flags, length, s.sink_tokens,
        h.layers, h.kv_heads, h.head_dim, h.tokens,
        c.DTYPE_CODES[h.dtype], c.COMPANDER_CODES[s.compander], c.CENTRING_CODES[s.centring],
        c.META_DTYPE_CODES[s.meta_dtype], s.anchor_bits, s.residual_bits, c.GRID_CODES[s.grid],
        c.VALUE_AXIS_CODES[s.value_axis],
        s.chunk, s.page, float(s.alpha), h.cache_id, len(h.prompt_token_ids), len(h.segments),
        len(fingerprint), len(names), len(properties),
    )
    body = fixed + var
    body += b"\x00" * (length - c.CRC_SIZE - len(body))
    return body + struct.pack("<I", crc32(body))


def check_prefix(buf, magic: bytes, known_flags: int, max_header: int, min_header: int,
                 file_size: int | None, what: str) -> tuple[int, int, int]:
    """magic -> version -> flags -> header_length; returns (minor, flags, header_length). Any minor version of
    major 1 is read: a later minor only adds what this reader ignores or rejects by a flag bit (spec §8)."""
    if len(buf) < PREFIX_SIZE:
        raise _err("magic", f"{what} byte 0", f"a header of at least {PREFIX_SIZE} bytes", f"{len(buf)} bytes")
    got_magic = bytes(buf[0:8])
    if got_magic != magic:  # the bytes of a foreign file are not shown
        raise _err("magic", f"{what} byte 0", magic.hex(), f"other bytes (not a .lynx {what} file)")
    major, minor, flags, length = struct.unpack_from("<HHII", buf, 8)
    if major != c.VERSION_MAJOR:
        raise _err("version_major", f"{what} byte 8", c.VERSION_MAJOR, major)
    if flags & ~known_flags:
        raise _err("flags", f"{what} byte 12", f"only bits {known_flags:#x}", f"{flags:#x}")
    if not (min_header <= length <= max_header) or length % c.HEADER_ALIGN:
        raise _err("header_length", f"{what} byte 16",
                   f"a multiple of {c.HEADER_ALIGN} in [{min_header}, {max_header}]", length)
    if file_size is not None and length > file_size:
        raise _err("header_length", f"{what} byte 16", f"<= file size {file_size}", length)
    return minor, flags, length


def check_header_crc(buf, length: int, what: str) -> None:
    """The whole header is there and its trailing CRC-32 matches bytes ``[0, length - 4)``."""
    if len(buf) < length:
        raise _err("header_length", f"{what} byte 16", f"<= {len(buf)} available bytes", length)
    stored_crc = struct.unpack_from("<I", buf, length - c.CRC_SIZE)[0]
    actual_crc = crc32(memoryview(buf)[: length - c.CRC_SIZE])
    if stored_crc != actual_crc:
        raise _err("header_crc32", f"{what} byte {length - c.CRC_SIZE}", f"{actual_crc:#010x}",
                   f"{stored_crc:#010x}", checksum=True)


def _check_anchor_prefix(buf, file_size: int | None) -> tuple[int, int, int]:
    return check_prefix(buf, c.ANCHOR_MAGIC, c.KNOWN_ANCHOR_FLAGS, c.MAX_ANCHOR_HEADER,
                         c.ANCHOR_FIXED_SIZE + c.CRC_SIZE, file_size, "anchor")


def anchor_header_length(prefix, file_size: int | None = None) -> int:
    """Check the first :data:`PREFIX_SIZE` bytes of an anchor file; return ``header_length``."""
    return _check_anchor_prefix(prefix, file_size)[2]


def check_range(name: str, value: int, cap: int, offsets: dict, what: str, low: int = 0) -> None:
    """``low <= value <= cap``, or the field error naming ``name`` at its offset."""
    if not low <= value <= cap:
        raise _err(name, f"{what} byte {offsets[name]}", f"{low} <= {name} <= {cap}", value)


def parse_anchor_header(buf, file_size: int | None = None) -> AnchorHeader:
    """Parse and validate an anchor header from ``buf`` (at least ``header_length`` bytes)."""
    what = "anchor"
    minor, flags, length = _check_anchor_prefix(buf, file_size)
    check_header_crc(buf, length, what)
    (_, _, _, _, _, sink_tokens, layers, kv_heads, head_dim, tokens, dtype, compander, centring, meta_dtype,
     anchor_bits, residual_bits, grid, value_axis, chunk, page, alpha, cache_id, n_prompt, n_seg, n_fp, n_names,
     n_props) = _ANCHOR_FIXED.unpack_from(buf, 0)
    off = c.ANCHOR_FIELD_OFFSETS
    check_range("layers", layers, c.MAX_LAYERS, off, what, 1)
    check_range("kv_heads", kv_heads, c.MAX_KV_HEADS, off, what, 1)
    check_range("head_dim", head_dim, c.MAX_HEAD_DIM, off, what, 1)
    check_range("tokens", tokens, c.MAX_TOKENS, off, what)
    check_range("prompt_token_count", n_prompt, c.MAX_PROMPT_TOKENS, off, what)
    check_range("segment_count", n_seg, c.MAX_SEGMENTS, off, what, 1)
    check_range("fingerprint_length", n_fp, c.MAX_FINGERPRINT, off, what)
    check_range("names_length", n_names, c.MAX_NAMES_LENGTH, off, what)
    if flags & c.FLAG_PROPERTIES:
        check_range("properties_length", n_props, c.MAX_PROPERTIES_LENGTH, off, what, 1)
    else:
        n_props = 0  # unused without the flag: ignored
    enums = (("dtype", dtype, c.DTYPE_CODES), ("compander", compander, c.COMPANDER_CODES),
             ("centring", centring, c.CENTRING_CODES), ("meta_dtype", meta_dtype, c.META_DTYPE_CODES),
             ("grid", grid, c.GRID_CODES), ("value_axis", value_axis, c.VALUE_AXIS_CODES))
    decoded = {}
    for name, value, table in enums:
        inv = _inv(table)
        if value not in inv:
            raise _err(name, f"{what} byte {off[name]}", f"one of {sorted(inv)}", value)
        decoded[name] = inv[value]
    try:
        scheme = Scheme(compander=decoded["compander"], alpha=alpha, centring=decoded["centring"], chunk=chunk,
                        page=page, anchor_bits=anchor_bits, residual_bits=residual_bits,
                        meta_dtype=decoded["meta_dtype"], grid=decoded["grid"], value_axis=decoded["value_axis"],
                        sink_tokens=sink_tokens,
                        key_rotation="hadamard" if flags & c.FLAG_KEY_ROTATION else "none",
                        extremes="range" if flags & c.FLAG_EXTREMES else "midpoint")
    except SchemeError as exc:
        raise FormatError(f"`scheme` at {what} bytes 20-23, 41-63: {exc}", field="scheme",
                          where=f"{what} byte 41") from None

    pos = c.ANCHOR_FIXED_SIZE
    end_of_content = length - c.CRC_SIZE
    need = n_seg * c.SEGMENT_SIZE + 4 * n_prompt + n_fp + n_names + n_props
    if pos + need > end_of_content:
        raise _err("header_length", f"{what} byte 16", f">= {_pad_to(pos + need + c.CRC_SIZE, c.HEADER_ALIGN)} "
                   "for the counts it declares", length)
    raw_segments = []
    for i in range(n_seg):
        kind, placement, loc_len, page_count, seg_off, seg_len, index_crc, reserved = _SEGMENT.unpack_from(buf, pos)
        at = f"{what} byte {pos}"
        if reserved:
            raise _err(f"segments[{i}].reserved", f"{what} byte {pos + 28}", 0, reserved)
        if placement not in (c.PLACEMENT_INLINE, c.PLACEMENT_EXTERNAL):
            raise _err(f"segments[{i}].placement", f"{what} byte {pos + 1}", "0 (inline) or 1 (external)", placement)
        if loc_len > c.MAX_LOCATION:
            raise _err(f"segments[{i}].location_length", f"{what} byte {pos + 2}", f"<= {c.MAX_LOCATION}", loc_len)
        if page_count > c.MAX_PAGE_ENTRIES:
            raise _err(f"segments[{i}].page_count", f"{what} byte {pos + 4}", f"<= {c.MAX_PAGE_ENTRIES}", page_count)
        raw_segments.append((kind, placement, loc_len, page_count, seg_off, seg_len, index_crc, at))
        pos += c.SEGMENT_SIZE
    need += sum(r[2] for r in raw_segments)
    if c.ANCHOR_FIXED_SIZE + need > end_of_content:
        raise _err("header_length", f"{what} byte 16", ">= the sizes of the strings it declares", length)
    prompt = struct.unpack_from(f"<{n_prompt}I", buf, pos)
    pos += 4 * n_prompt
    segments = []
    for i, (kind, placement, loc_len, page_count, seg_off, seg_len, index_crc, at) in enumerate(raw_segments):
        try:
            location = bytes(buf[pos:pos + loc_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise _err(f"segments[{i}].location", f"{what} byte {pos}", "UTF-8 text", "invalid UTF-8") from None
        if placement == c.PLACEMENT_INLINE and loc_len:
            raise _err(f"segments[{i}].location_length", at, "0 for an inline segment", loc_len)
        if placement == c.PLACEMENT_EXTERNAL and (not loc_len or seg_off):
            raise _err(f"segments[{i}].location", at, "a location string and offset 0 for an external segment",
                       f"length {loc_len}, offset {seg_off}")
        segments.append(SegmentEntry(kind, placement, page_count, seg_off, seg_len, index_crc, location))
        pos += loc_len
    fp_bytes = bytes(buf[pos:pos + n_fp])
    if n_fp not in (0, c.FINGERPRINT_HEX_LENGTH) or any(ch not in b"0123456789abcdef" for ch in fp_bytes):
        raise _err("fingerprint", f"{what} byte {pos}", f"empty or {c.FINGERPRINT_HEX_LENGTH} lowercase hex digits",
                   repr(fp_bytes[:64]))
    pos += n_fp
    try:
        names_text = bytes(buf[pos:pos + n_names]).decode("utf-8")
    except UnicodeDecodeError:
        raise _err("names", f"{what} byte {pos}", "UTF-8 text", "invalid UTF-8") from None
    names = tuple(names_text.split("\n")) if n_names else ()
    problem = names_problem(names, layers)
    if problem is not None:
        raise FormatError(f"`names` at {what} byte {pos}: expected {problem}", field="names", where=f"{what} byte {pos}")
    pos += n_names
    properties = parse_properties(bytes(buf[pos:pos + n_props]), f"{what} byte {pos}") if n_props else ()
    pos += n_props
    padding = bytes(buf[pos:end_of_content])
    if any(padding):
        raise _err("padding", f"{what} byte {pos}", "zero bytes before the header CRC", padding.hex())
    if _pad_to(pos + c.CRC_SIZE, c.HEADER_ALIGN) != length:
        raise _err("header_length", f"{what} byte 16", _pad_to(pos + c.CRC_SIZE, c.HEADER_ALIGN), length)

    h = AnchorHeader(layers, kv_heads, head_dim, tokens, decoded["dtype"], scheme, bytes(cache_id),
                     tuple(segments), tuple(prompt), fp_bytes.decode("ascii"), names, flags, minor, length,
                     properties)
    _check_segments(h)
    return h


def _check_segments(h: AnchorHeader) -> None:
    """The segment table: first an inline anchor segment right after the header, at most one residual."""
    what = "anchor"
    seg_base = c.ANCHOR_FIXED_SIZE
    pages = h.layers * h.pages_per_layer
    if pages > c.MAX_PAGE_ENTRIES:
        raise _err("tokens", f"{what} byte 36", f"layers x pages <= {c.MAX_PAGE_ENTRIES}", pages)
    first = h.segments[0]
    if first.kind != c.SEGMENT_ANCHOR or first.placement != c.PLACEMENT_INLINE:
        raise _err("segments[0].kind", f"{what} byte {seg_base}", "an inline anchor segment (kind 1, placement 0)",
                   f"kind {first.kind}, placement {first.placement}")
    if first.offset != h.header_length:
        raise _err("segments[0].offset", f"{what} byte {seg_base + 8}", h.header_length, first.offset)
    seen = {c.SEGMENT_ANCHOR}
    for i, seg in enumerate(h.segments):
        at = f"{what} byte {seg_base + i * c.SEGMENT_SIZE}"
        if seg.kind in c.SEGMENT_KINDS and seg.page_count != pages:
            raise _err(f"segments[{i}].page_count", f"{what} byte {seg_base + i * c.SEGMENT_SIZE + 4}",
                       f"layers x pages_per_layer = {pages}", seg.page_count)
        if i and seg.kind == c.SEGMENT_ANCHOR or i and seg.kind in seen:
            raise _err(f"segments[{i}].kind", at, "each segment kind at most once", seg.kind)
        if seg.kind == 0:
            raise _err(f"segments[{i}].kind", at, "a nonzero kind", 0)
        seen.add(seg.kind)
    # Inline sections follow each other without gaps, in table order.
    pos = h.header_length
    for i, seg in enumerate(h.segments):
        if seg.placement != c.PLACEMENT_INLINE:
            continue
        if seg.offset != pos:
            raise _err(f"segments[{i}].offset", f"{what} byte {seg_base + i * c.SEGMENT_SIZE + 8}", pos, seg.offset)
        pos += seg.length


def inline_end(h: AnchorHeader) -> int:
    """The exact size of the anchor file: header plus every inline section."""
    return h.header_length + sum(s.length for s in h.segments if s.placement == c.PLACEMENT_INLINE)



def exact_record_length(h: AnchorHeader, n: int) -> int:
    """The raw exact record of a page of ``n`` tokens: the original bytes' CRC-32, then K and V's byte planes."""
    elements, element_bytes = 2 * h.kv_heads * n * h.head_dim, c.DTYPE_BYTES[h.dtype]
    return c.EXACT_RECORD_CRC_SIZE + elements * element_bytes


# ---------------------------------------------------------------------------------------------------------
# sizes the anchor header declares
# ---------------------------------------------------------------------------------------------------------
def decoded_bytes(h: AnchorHeader, element_bytes: int) -> int:
    """Bytes of the dequantized KV the header declares: 2 (K, V) x layers x kv_heads x tokens x head_dim x
    ``element_bytes``."""
    return 2 * h.layers * h.kv_heads * h.tokens * h.head_dim * element_bytes


def raw_lengths(h: AnchorHeader, kind: int) -> list[int]:
    """The raw record length of every page of a segment, in streaming order (layer-major)."""
    per_page = []
    for p in range(h.pages_per_layer):
        n = page_tokens(h.tokens, h.scheme.page, p)
        if kind == c.SEGMENT_ANCHOR:
            lay = anchor_record_layout(h.scheme, h.kv_heads, h.head_dim, n, page_sinks(h.scheme, h.tokens, p))
        elif kind == c.SEGMENT_EXACT:
            per_page.append(exact_record_length(h, n))
            continue
        else:
            lay = residual_record_layout(h.scheme, h.kv_heads, h.head_dim, n)
        per_page.append(lay.raw_length)
    if any(r > c.MAX_PAGE_RAW for r in per_page):
        raise _err("page", "anchor byte 52", f"pages of at most {c.MAX_PAGE_RAW} bytes", max(per_page))
    return per_page * h.layers
