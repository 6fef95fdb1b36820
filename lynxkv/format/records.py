"""Page records: the bytes of one (layer, page) of one segment, and their codec (none | zstd | zstd frames).

Anchor record for a page of n tokens (nc = ceil(n / C) chunks), all little-endian, no padding:

    K offsets [H, nc, D] meta dtype | K scales | V offsets | V scales |
    K anchor codes, pack_bits over the flattened [H, n, D] | V anchor codes, likewise |
    (a page holding S of the scheme's sink tokens) their K residual codes [H, S, D] packed | V, likewise

(values grouped per channel: V offsets and scales are [H, n, ceil(D/C)])

Residual record: K residual codes packed | V residual codes packed. Anchor-only decoding therefore needs only
anchor records. :func:`check_and_decompress` checks the CRC-32 of the stored bytes first, then decompresses with
the output bounded by the raw length the shape implies. :func:`record_parts` says where each part of a record
lies; :func:`dequantize_records` (what ``load_kv`` and the progressive reader use) hands those places to the
quantizer entry, which dequantizes the codes straight from the record bytes into the output tensors, while
:func:`decode_anchor_records` / :func:`decode_residual_records` split records into code and metadata tensors (one
page, or all full pages of a layer at once) for callers that want the codes themselves. Encoding goes through
:func:`encode_anchor_record` / :func:`encode_residual_record` (a page's slices), or :func:`encode_layer_records`
(every page of a layer, the same bytes); these and the decoders are the only places where the format calls the
quantizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lynxkv.errors import ChecksumError, FormatError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.layout import PageEntry, RecordLayout, anchor_record_layout, residual_record_layout, sinks_in
from lynxkv.quant import META_TORCH_DTYPE, EncodedTensor, dequantize, dequantize_pages, pack_bits, unpack_bits
from lynxkv.quant.device_pages import device_bytes
from lynxkv.quant.scheme import Scheme

_META_NP = {"fp16": np.dtype("<f2"), "fp32": np.dtype("<f4")}


@dataclass(frozen=True)
class AnchorPage:
    """The decoded anchor record of one (layer, page)."""

    key_offset: torch.Tensor  # meta dtype [H, nc, D]
    key_scale: torch.Tensor  # meta dtype [H, nc, D]
    value_offset: torch.Tensor
    value_scale: torch.Tensor
    key_anchor: torch.Tensor  # uint8 [H, n, D]
    value_anchor: torch.Tensor  # uint8 [H, n, D]
    key_sinks: torch.Tensor | None = None  # uint8 [H, S, D]: the residual codes of the page's sink tokens
    value_sinks: torch.Tensor | None = None


@dataclass(frozen=True)
class ResidualPage:
    key_residual: torch.Tensor  # uint8 [H, n, D]
    value_residual: torch.Tensor  # uint8 [H, n, D]


def _meta_bytes(t: torch.Tensor, meta_dtype: str) -> bytes:
    return t.numpy().astype(_META_NP[meta_dtype], copy=False).tobytes()  # tobytes copies a page slice in C order


def _code_bytes(codes: torch.Tensor, bits: int, packed: bool) -> bytes:
    """``pack_bits`` of a page slice of codes ``[H, n, D]`` (read in place), or the slice's own bytes where the
    codes are already packed (``[H, n, D/2]``, :attr:`EncodedTensor.packed`: the same bytes)."""
    return (codes.numpy() if packed else pack_bits(codes, bits).numpy()).tobytes()  # tobytes: C order


def encode_anchor_record(k: EncodedTensor, v: EncodedTensor, scheme: Scheme) -> bytes:
    """``k``/``v``: one page of keys/values (``EncodedTensor.tokens`` slices), codes packed or not."""
    md = scheme.meta_dtype
    parts = [_meta_bytes(k.offset, md), _meta_bytes(k.scale, md), _meta_bytes(v.offset, md), _meta_bytes(v.scale, md),
             _code_bytes(k.anchor, scheme.anchor_bits, k.packed), _code_bytes(v.anchor, scheme.anchor_bits, v.packed)]
    if k.sinks:
        parts += [_code_bytes(t.residual[:, :t.sinks], scheme.residual_bits, t.packed) for t in (k, v)]
    return b"".join(parts)


def encode_residual_record(k: EncodedTensor, v: EncodedTensor, scheme: Scheme) -> bytes:
    return (_code_bytes(k.residual, scheme.residual_bits, k.packed)
            + _code_bytes(v.residual, scheme.residual_bits, v.packed))


def _page_rows(a: np.ndarray, p0: int, n: int, rows: int) -> np.ndarray:
    """``[n, H, rows, ...]``: pages ``p0 .. p0 + n`` of ``rows`` rows each along axis 1 of ``a`` ``[H, R, ...]``
    (a view: the page axis moved first)."""
    h = a.shape[0]
    return a[:, p0 * rows:(p0 + n) * rows].reshape(h, n, rows, *a.shape[2:]).swapaxes(0, 1)


def encode_layer_records(k: EncodedTensor, v: EncodedTensor, scheme: Scheme, tokens: int):
    """The ``(anchor, residual)`` records of each page of one layer, in page order, each a bytes-like object (the
    bytes of :func:`encode_anchor_record` / :func:`encode_residual_record` of the page's slices). The full pages
    without sink tokens of packed codes (:attr:`EncodedTensor.packed`) are laid out in one buffer per segment,
    each part of every page by one strided copy, instead of a slice, a copy and a join per part and page."""
    page, chunk = scheme.page, scheme.chunk
    pages, full = -(-tokens // page), tokens // page
    first = -(-min(k.sinks, tokens) // page)  # the pages holding sink tokens: records of their own

    def one(p: int):
        start, stop = p * page, min((p + 1) * page, tokens)
        ks, vs = k.tokens(start, stop, chunk), v.tokens(start, stop, chunk)
        return encode_anchor_record(ks, vs, scheme), encode_residual_record(ks, vs, scheme)

    if not (k.packed and v.packed and page % chunk == 0 and full > first):
        yield from map(one, range(pages))
        return
    yield from map(one, range(first))
    n, md = full - first, scheme.meta_dtype

    def meta(t: torch.Tensor, axis: str) -> np.ndarray:
        rows = page // chunk if axis == "token" else page
        return _page_rows(t.numpy().astype(_META_NP[md], copy=False).view(np.uint8), first, n, rows)

    segments = []
    for parts in ([meta(k.offset, k.axis), meta(k.scale, k.axis), meta(v.offset, v.axis), meta(v.scale, v.axis),
                   _page_rows(k.anchor.numpy(), first, n, page), _page_rows(v.anchor.numpy(), first, n, page)],
                  [_page_rows(k.residual.numpy(), first, n, page), _page_rows(v.residual.numpy(), first, n, page)]):
        sizes = [int(np.prod(x.shape[1:])) for x in parts]
        buf = np.empty((n, sum(sizes)), dtype=np.uint8)
        at = 0
        for x, size in zip(parts, sizes):
            np.copyto(buf[:, at:at + size].reshape(x.shape), x)
            at += size
        segments.append((memoryview(buf).cast("B"), at))  # a page record every `at` bytes
    (a, na), (r, nr) = segments
    for i in range(n):
        yield a[i * na:(i + 1) * na], r[i * nr:(i + 1) * nr]
    yield from map(one, range(full, pages))  # a last partial page


def compress(raw: bytes, codec: int, level: int = 3) -> bytes:
    if codec == c.CODEC_NONE:
        return raw
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True).compress(raw)


def compress_frames(raw, splits, level: int) -> bytes:
    """Codec 2 (zstd frames, exact pages only): one Zstandard frame per run of ``raw`` between consecutive ``splits`` (byte
    offsets, increasing, within ``raw``), one after another; an empty run gets no frame."""
    import zstandard

    z = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    view = memoryview(raw)
    bounds = [0, *splits, len(raw)]
    return b"".join(z.compress(view[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a)


def choose_codec(raw: bytes, zstd: bool, level: int = 3, splits: list[int] | None = None) -> tuple[int, bytes]:
    """zstd (at ``level``; with ``splits``, zstd frames split there: codec 2) only where it makes the page
    smaller; otherwise the page is stored raw (codec none)."""
    if zstd and raw:
        codec = c.CODEC_ZSTD if splits is None else c.CODEC_ZSTD_FRAMES
        packed = compress(raw, c.CODEC_ZSTD, level) if splits is None else compress_frames(raw, splits, level)
        if len(packed) < len(raw):
            return codec, packed
    return c.CODEC_NONE, raw


def check_and_decompress(stored, entry: PageEntry, where: str) -> bytes | memoryview:
    """Verify the page CRC over the stored bytes, then undo the codec (output bounded by ``raw_length``)."""
    if len(stored) != entry.stored_length:
        raise FormatError(f"`page` {where}: expected {entry.stored_length} stored bytes, got {len(stored)}",
                          field="page", where=where)
    got = crc32(stored)
    if got != entry.crc32:
        raise ChecksumError(f"`page.crc32` {where}: expected {entry.crc32:#010x}, got {got:#010x} "
                            "(the page bytes are corrupt)", field="page.crc32", where=where)
    if entry.codec == c.CODEC_NONE:
        return stored
    import zstandard

    import io

    # Streamed, and never more than raw_length + 1 bytes out, whatever the frame header claims: a frame that
    # would inflate further is refused before it can allocate. Codec 2: every frame, one after another.
    across = entry.codec == c.CODEC_ZSTD_FRAMES
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored), read_across_frames=across) as r:
            raw = r.read(entry.raw_length + 1)
            rest = r.read(1) if len(raw) == entry.raw_length else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"`page` {where}: zstd payload does not decode ({exc})", field="page",
                          where=where) from None
    if len(raw) > entry.raw_length or rest:
        raise FormatError(f"`page.raw_length` {where}: the zstd payload inflates past the {entry.raw_length} "
                          "bytes the index declares", field="page.raw_length", where=where)
    if len(raw) != entry.raw_length:
        raise FormatError(f"`page.raw_length` {where}: expected {entry.raw_length} decoded bytes, got {len(raw)}",
                          field="page.raw_length", where=where)
    return raw


def _codes(buf: np.ndarray, start: int, lay: RecordLayout, bits: int, count: int, where: str,
           what: tuple[str, str]) -> torch.Tensor:
    """The K and V code arrays of ``pages`` records (rows of ``buf``) as ``[2, pages, count]`` uint8.

    Where ``count·bits`` is a multiple of 8 the 2·pages packed arrays join into one bit stream without padding
    and unpack in one pass; otherwise each is unpacked on its own and its padding bits must be zero."""
    pages, size = buf.shape[0], lay.codes_size
    block = np.ascontiguousarray(buf[:, start:start + 2 * size])  # [pages, K codes | V codes]
    if count * bits % 8 == 0:
        return unpack_bits(torch.from_numpy(block.reshape(-1)), bits, pages * 2 * count).view(pages, 2, count)
    out = torch.empty((pages, 2, count), dtype=torch.uint8)
    pad = count * bits % 8
    for p in range(pages):
        for j in range(2):
            packed = block[p, j * size:(j + 1) * size]
            if int(packed[-1]) >> pad:
                raise FormatError(f"`{what[j]}` {where}: padding bits after the last code must be zero",
                                  field=what[j], where=where)
            out[p, j] = unpack_bits(torch.from_numpy(packed.copy()), bits, count)
    return out


def _rows(raws: list, lay: RecordLayout, where: str) -> np.ndarray:
    for raw in raws:
        if len(raw) != lay.raw_length:
            raise FormatError(f"`page.raw_length` {where}: expected {lay.raw_length}, got {len(raw)}",
                              field="page.raw_length", where=where)
    return np.frombuffer(bytearray(b"".join(raws)), dtype=np.uint8).reshape(len(raws), lay.raw_length)


_META_NAMES = ("key_offset", "key_scale", "value_offset", "value_scale")


_FLOAT_BITS = {2: (np.uint16, 0x7C00, 0x8000), 4: (np.uint32, 0x7F800000, 0x80000000)}  # (view, exponent, sign)


def _check_metadata(m: np.ndarray, where: str, first: int = 0) -> None:
    """Offsets and scales ``m`` ``[pages, 2, ...]`` (of K: ``first`` 0, of V: 2) are finite, scales >= 0 (what
    the quantizer writes; spec §9.2). Checked on the bit patterns (all-ones exponent: infinity or NaN; sign bit on
    a non-zero scale: negative), one pass."""
    view, exponent, sign = _FLOAT_BITS[m.dtype.itemsize]
    bits = m.view(view)
    bad = (bits & exponent) == exponent
    scales = bits[:, 1::2]
    negative = ((scales & sign) != 0) & (scales != sign)  # -0.0 is zero, not negative
    if not (bad.any() or negative.any()):
        return
    for j, name in enumerate(_META_NAMES[first:first + 2]):
        if bad[:, j].any():
            raise FormatError(f"`{name}` {where}: expected finite values, got NaN or infinity", field=name,
                              where=where)
        if j % 2 and negative[:, j // 2].any():
            raise FormatError(f"`{name}` {where}: expected scales >= 0, got {float(m[:, j].min())}", field=name,
                              where=where)


def decode_anchor_records(raws: list, lay: RecordLayout, scheme: Scheme, kv_heads: int, head_dim: int,
                          where: str = "anchor") -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """Split raw (CRC-checked, decompressed) anchor records of ``lay.tokens`` tokens each -- one page, or the
    consecutive full pages of a layer in one vectorised pass.

    Returns (metadata -- K offsets, K scales ``[H, pages·nc, D]``, V offsets, V scales, the same or per channel
    ``[H, pages·n, ceil(D/C)]`` --, codes ``[2, H, pages·n, D]`` -- K, V --, the residual codes ``[2, H, S, D]``
    of the S sink tokens of a page that holds any (then decoded on its own), else None), the pages concatenated
    along the token axis."""
    buf = _rows(raws, lay, where)
    pages, n, H, D = buf.shape[0], lay.tokens, kv_heads, head_dim
    nc = -(-n // scheme.chunk)
    np_dtype = _META_NP[scheme.meta_dtype]
    key_shape = (H, nc, D)
    value_shape = (H, n, -(-D // scheme.chunk)) if scheme.value_axis == "channel" else key_shape
    meta_end = 2 * (lay.meta_size + lay.value_meta)
    m = np.ascontiguousarray(buf[:, :meta_end]).view(np_dtype).astype(np_dtype.newbyteorder("="), copy=False)
    ks = 2 * lay.meta_size // np_dtype.itemsize
    key_meta = m[:, :ks].reshape(pages, 2, *key_shape)
    value_meta = m[:, ks:].reshape(pages, 2, *value_shape)
    _check_metadata(key_meta.reshape(pages, 2, -1), where)
    _check_metadata(value_meta.reshape(pages, 2, -1), where, first=2)
    meta = [torch.from_numpy(np.ascontiguousarray(part[:, j].transpose(1, 0, 2, 3)).reshape(H, -1, shape[2]))
            .to(META_TORCH_DTYPE[scheme.meta_dtype]) for part, shape in ((key_meta, key_shape),
                                                                         (value_meta, value_shape)) for j in (0, 1)]
    codes = _codes(buf, meta_end, lay, scheme.anchor_bits, H * n * D, where, ("key_anchor", "value_anchor"))
    codes = codes.view(pages, 2, H, n, D).permute(1, 2, 0, 3, 4).reshape(2, H, pages * n, D)
    sinks = None
    if lay.sinks:  # a page with sink tokens is decoded on its own
        sink_lay = RecordLayout(lay.sinks, 0, lay.sink_size, 0)
        sinks = _codes(buf, meta_end + 2 * lay.codes_size, sink_lay, scheme.residual_bits, H * lay.sinks * D, where,
                       ("key_sinks", "value_sinks")).view(2, H, lay.sinks, D)
    return meta, codes, sinks


def decode_residual_records(raws: list, lay: RecordLayout, scheme: Scheme, kv_heads: int, head_dim: int,
                            where: str = "residual") -> torch.Tensor:
    """Split raw residual records (as :func:`decode_anchor_records`): codes ``[2, H, pages·n, D]`` (K, V)."""
    buf = _rows(raws, lay, where)
    pages, n, H, D = buf.shape[0], lay.tokens, kv_heads, head_dim
    codes = _codes(buf, 0, lay, scheme.residual_bits, H * n * D, where, ("key_residual", "value_residual"))
    return codes.view(pages, 2, H, n, D).permute(1, 2, 0, 3, 4).reshape(2, H, pages * n, D)


def join_records(raws: Sequence[bytes]) -> tuple[bytes, list[int]]:
    """Raw records in one buffer and where each starts in it: what :func:`dequantize_records` takes. No copy for
    one record, nor for records that already lie back to back in one buffer (pages of a memory-mapped file read in
    place): one view then spans them."""
    at = [0]
    for raw in raws[:-1]:
        at.append(at[-1] + len(raw))
    if len(raws) == 1:
        return raws[0], at
    span = _adjacent_views(raws)
    return (b"".join(raws) if span is None else span), at


def _address(buf) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data


def _adjacent_views(raws: Sequence) -> memoryview | None:
    """One view of the bytes ``raws`` cover when they are views of one object lying back to back, else None."""
    first = raws[0]
    if not all(isinstance(r, memoryview) and r.obj is first.obj and r.c_contiguous and r.nbytes for r in raws):
        return None
    at = [_address(r) for r in raws]
    if any(a + r.nbytes != b for a, r, b in zip(at, raws, at[1:])):
        return None
    whole = memoryview(first.obj)
    if not whole.c_contiguous:
        return None
    whole = whole.cast("B")
    base = _address(whole)
    start, end = at[0] - base, at[-1] + raws[-1].nbytes - base
    return whole[start:end] if 0 <= start and end <= whole.nbytes else None


def record_parts(lay: RecordLayout) -> dict[str, int]:
    """Where each part of a raw record starts (bytes from the record's first byte), in record order."""
    if lay.meta_arrays:
        m, v = lay.meta_size, lay.value_meta
        k = 2 * (m + v)
        parts = {"key_offset": 0, "key_scale": m, "value_offset": 2 * m, "value_scale": 2 * m + v, "key_anchor": k,
                 "value_anchor": k + lay.codes_size}
        if lay.sinks:
            s = k + 2 * lay.codes_size
            parts.update(key_sinks=s, value_sinks=s + lay.sink_size)
        return parts
    return {"key_residual": 0, "value_residual": lay.codes_size}


def dequantize_records(anchor, anchor_at: Sequence[int], residual, residual_at: Sequence[int] | None,
                       tokens: Sequence[tuple[int, int]], scheme: Scheme, kv_heads: int, head_dim: int,
                       out: tuple[torch.Tensor, torch.Tensor], where: Callable[[int], str],
                       threads: int | None = None, on_device: tuple | None = None, *, first: int = 0) -> None:
    """Dequantize raw (CRC-checked, decompressed) page records of one layer straight into its keys and values.

    Page ``i`` holds tokens ``[t0, t0 + n)`` (``tokens[i]``); its anchor record starts at byte ``anchor_at[i]``
    of ``anchor``, its residual record at ``residual_at[i]`` of ``residual`` (``None``: the anchor alone).
    ``out`` is ``(keys, values)``, ``[H, T, D]`` each (any strides), written in place through the quantizer
    entry (:func:`lynxkv.quant.dequantize_pages`: nothing is unpacked, permuted or concatenated first).
    ``where(i)`` names page ``i`` in errors (``"layer 3 page 1"``; the segment is put before it). The checks of
    :func:`decode_anchor_records` apply: the record sizes, zero padding bits after the last code, finite offsets
    and scales, scales >= 0. Values per channel take the entry's channel-axis pass; from the anchor
    alone, the sink tokens of a page holding any are then decoded again from the full code (their residual is in
    the anchor record, split out by :func:`decode_anchor_records`). ``on_device``: ``(anchor, residual)`` already
    copied to ``out``'s device as flat uint8 tensors (a caller that stages the bytes itself, e.g. through pinned
    memory with an asynchronous copy); else, for outputs off the CPU, the records are copied there here. The
    checks above always read the host bytes. ``first``: the layer's token that is token 0 of ``out`` (and of
    ``tokens``), where the pages decoded are a later part of the layer's (which of its tokens are sink tokens
    depends on it)."""
    segments = [("anchor", anchor, anchor_at, scheme.anchor_bits)]
    if residual is not None:
        segments.append(("residual", residual, residual_at, scheme.residual_bits))
    rows: tuple[list, list] = ([], [])
    layouts: dict[tuple[str, int, int], tuple[RecordLayout, dict[str, int]]] = {}  # the pages mostly share one
    for i, (t0, n) in enumerate(tokens):
        count = kv_heads * n * head_dim
        sinks = sinks_in(scheme, first + t0, n)
        parts = {}
        for kind, buf, at, bits in segments:
            known = layouts.get((kind, n, sinks))
            if known is None:
                lay = (anchor_record_layout(scheme, kv_heads, head_dim, n, sinks)
                       if kind == "anchor" else residual_record_layout(scheme, kv_heads, head_dim, n))
                known = layouts[(kind, n, sinks)] = (lay, record_parts(lay))
            lay, offsets = known
            if at[i] + lay.raw_length > len(buf):
                place = f"{kind} {where(i)}"
                raise FormatError(f"`page.raw_length` {place}: expected {lay.raw_length} bytes, got "
                                  f"{len(buf) - at[i]}", field="page.raw_length", where=place)
            here = {name: at[i] + off for name, off in offsets.items()}
            pad = count * bits % 8
            for name in ("key_" + kind, "value_" + kind) if pad else ():
                if buf[here[name] + lay.codes_size - 1] >> pad:
                    place = f"{kind} {where(i)}"
                    raise FormatError(f"`{name}` {place}: padding bits after the last code must be zero",
                                      field=name, where=place)
            parts.update(here)
        for j, which in enumerate(("key", "value")):
            rows[j].append((parts[f"{which}_offset"], parts[f"{which}_scale"], parts[f"{which}_anchor"],
                            parts.get(f"{which}_residual", 0), t0, n))
    host = anchor  # the flags' messages below read the host bytes
    if on_device is not None:
        anchor, residual = on_device
    elif out[0].device.type != "cpu":  # the records cross to the device once for the keys, the values and the sinks
        anchor, residual = device_bytes(anchor, out[0].device), device_bytes(residual, out[0].device)
    for j, which in enumerate(("key", "value")):
        if rows[j] and dequantize_pages(anchor, residual, rows[j], scheme, out=out[j], threads=threads, kind=which):
            for i, (t0, n) in enumerate(tokens):  # decode_anchor_records names the page and the field
                lay = anchor_record_layout(scheme, kv_heads, head_dim, n, sinks_in(scheme, first + t0, n))
                decode_anchor_records([host[anchor_at[i]:anchor_at[i] + lay.raw_length]], lay, scheme, kv_heads,
                                      head_dim, f"anchor {where(i)}")
            raise FormatError(f"`page` anchor {where(0)}: metadata out of range", field="page",
                              where=f"anchor {where(0)}")
    sinks = ([i for i, (t0, n) in enumerate(tokens) if first + t0 < scheme.sink_tokens and n] if residual is None
             else [])
    if sinks:
        _sinks_from_full_code(anchor, host, [anchor_at[i] for i in sinks], [tokens[i] for i in sinks], scheme,
                              kv_heads, head_dim, out, lambda k: where(sinks[k]), threads, first)


def _sinks_from_full_code(anchor, host, anchor_at, tokens, scheme: Scheme, kv_heads: int, head_dim: int,
                          out: tuple[torch.Tensor, torch.Tensor], where: Callable[[int], str],
                          threads: int | None, first: int = 0) -> None:
    """The sink tokens of pages already decoded from the anchor alone, again from the full code: their residual
    codes are in the anchor record (any scheme). ``anchor``: the records where the output is (a device's copy, or
    ``host`` itself), ``host``: the records' bytes on the host.

    With the 4+4 split the sink rows of a page are one page row of the quantizer entry, read in place: the first
    S of the page's n tokens per head, with the record's ``[H, S, D]`` sink array as their residual; other splits
    unpack the record first."""
    H, D = kv_heads, head_dim
    for i, (t0, n) in enumerate(tokens):
        sinks = sinks_in(scheme, first + t0, n)
        lay = anchor_record_layout(scheme, H, D, n, sinks)
        if scheme.anchor_bits == scheme.residual_bits == 4 and D % 2 == 0:
            parts = {name: anchor_at[i] + off for name, off in record_parts(lay).items()}
            for j, which in enumerate(("key", "value")):  # the first `sinks` of the page's n tokens per head
                row = (parts[f"{which}_offset"], parts[f"{which}_scale"], parts[f"{which}_anchor"],
                       parts[f"{which}_sinks"], 0, sinks, n, sinks)
                dequantize_pages(anchor, anchor, [row], scheme, out=out[j][:, t0:t0 + sinks], threads=threads,
                                 kind=which)
            continue
        meta, codes, sink_codes = decode_anchor_records([host[anchor_at[i]:anchor_at[i] + lay.raw_length]], lay,
                                                        scheme, H, D, f"anchor {where(i)}")
        resid = torch.zeros_like(codes)
        resid[:, :, :sinks] = sink_codes
        for j, which in enumerate(("key", "value")):
            enc = EncodedTensor(codes[j], resid[j], meta[2 * j], meta[2 * j + 1], scheme.axis(which),
                                rotated=scheme.rotated(which))
            dequantize(enc.tokens(0, sinks, scheme.chunk), scheme, out=out[j][:, t0:t0 + sinks], threads=threads)


def anchor_page(meta: list[torch.Tensor], codes: torch.Tensor, sinks: torch.Tensor | None) -> AnchorPage:
    return AnchorPage(meta[0], meta[1], meta[2], meta[3], codes[0], codes[1],
                      *((None, None) if sinks is None else (sinks[0], sinks[1])))


def residual_page(codes: torch.Tensor) -> ResidualPage:
    return ResidualPage(codes[0], codes[1])
