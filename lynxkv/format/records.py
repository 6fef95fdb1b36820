"""Page records: the bytes of one (layer, page) of one segment, and their codec (none | zstd).

Anchor record for a page of n tokens (nc = ceil(n / C) chunks), all little-endian, no padding:

    K offsets [H, nc, D] meta dtype | K scales | V offsets | V scales |
    K anchor codes, pack_bits over the flattened [H, n, D] | V anchor codes, likewise

Residual record: K residual codes packed | V residual codes packed. Anchor-only decoding therefore needs only
anchor records. ``decode_*`` check the CRC-32 of the stored bytes first, then decompress with the output size
bounded by the raw length the shape implies, then split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lynxkv.errors import ChecksumError, FormatError
from lynxkv.format import constants as c
from lynxkv.format.layout import PageEntry, RecordLayout, crc32
from lynxkv.quant import pack_bits, unpack_bits
from lynxkv.quant import META_TORCH_DTYPE, EncodedTensor
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


@dataclass(frozen=True)
class ResidualPage:
    key_residual: torch.Tensor  # uint8 [H, n, D]
    value_residual: torch.Tensor  # uint8 [H, n, D]


def _meta_bytes(t: torch.Tensor, meta_dtype: str) -> bytes:
    return t.contiguous().numpy().astype(_META_NP[meta_dtype], copy=False).tobytes()


def encode_anchor_record(k: EncodedTensor, v: EncodedTensor, scheme: Scheme) -> bytes:
    """``k``/``v``: one page of keys/values (``EncodedTensor.tokens`` slices)."""
    md = scheme.meta_dtype
    parts = [_meta_bytes(k.offset, md), _meta_bytes(k.scale, md), _meta_bytes(v.offset, md), _meta_bytes(v.scale, md),
             pack_bits(k.anchor.contiguous(), scheme.anchor_bits).numpy().tobytes(),
             pack_bits(v.anchor.contiguous(), scheme.anchor_bits).numpy().tobytes()]
    return b"".join(parts)


def encode_residual_record(k: EncodedTensor, v: EncodedTensor, scheme: Scheme) -> bytes:
    return (pack_bits(k.residual.contiguous(), scheme.residual_bits).numpy().tobytes()
            + pack_bits(v.residual.contiguous(), scheme.residual_bits).numpy().tobytes())


def compress(raw: bytes, codec: int, level: int = 3) -> bytes:
    if codec == c.CODEC_NONE:
        return raw
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True).compress(raw)


def choose_codec(raw: bytes, zstd: bool) -> tuple[int, bytes]:
    """zstd only where it makes the page smaller; otherwise the page is stored raw (codec none)."""
    if zstd and raw:
        packed = compress(raw, c.CODEC_ZSTD)
        if len(packed) < len(raw):
            return c.CODEC_ZSTD, packed
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

    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=entry.raw_length)
    except zstandard.ZstdError as exc:
        raise FormatError(f"`page` {where}: zstd payload does not decode ({exc})", field="page",
                          where=where) from None
    if len(raw) != entry.raw_length:
        raise FormatError(f"`page.raw_length` {where}: expected {entry.raw_length} decoded bytes, got {len(raw)}",
                          field="page.raw_length", where=where)
    return raw


def _meta(raw, start: int, shape: tuple, meta_dtype: str) -> torch.Tensor:
    count = shape[0] * shape[1] * shape[2]
    arr = np.frombuffer(raw, dtype=_META_NP[meta_dtype], count=count, offset=start).reshape(shape)
    return torch.from_numpy(arr.astype(_META_NP[meta_dtype].newbyteorder("="), copy=True)).to(
        META_TORCH_DTYPE[meta_dtype])


def _codes(raw, start: int, size: int, bits: int, shape: tuple, where: str, what: str) -> torch.Tensor:
    packed = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, count=size, offset=start).copy())
    count = shape[0] * shape[1] * shape[2]
    values = unpack_bits(packed, bits, count)
    if count * bits % 8 and int(packed[-1]) >> (count * bits % 8):
        raise FormatError(f"`{what}` {where}: padding bits after the last code must be zero",
                          field=what, where=where)
    return values.view(shape)


def decode_anchor_record(raw, lay: RecordLayout, scheme: Scheme, kv_heads: int, head_dim: int,
                         where: str = "anchor") -> AnchorPage:
    """Split a raw (CRC-checked, decompressed) anchor record of ``lay.tokens`` tokens."""
    if len(raw) != lay.raw_length:
        raise FormatError(f"`page.raw_length` {where}: expected {lay.raw_length}, got {len(raw)}",
                          field="page.raw_length", where=where)
    n = lay.tokens
    meta_shape = (kv_heads, -(-n // scheme.chunk), head_dim)
    code_shape = (kv_heads, n, head_dim)
    m = lay.meta_size
    metas = [_meta(raw, i * m, meta_shape, scheme.meta_dtype) for i in range(4)]
    k = _codes(raw, 4 * m, lay.codes_size, scheme.anchor_bits, code_shape, where, "key_anchor")
    v = _codes(raw, 4 * m + lay.codes_size, lay.codes_size, scheme.anchor_bits, code_shape, where, "value_anchor")
    return AnchorPage(metas[0], metas[1], metas[2], metas[3], k, v)


def decode_residual_record(raw, lay: RecordLayout, scheme: Scheme, kv_heads: int, head_dim: int,
                           where: str = "residual") -> ResidualPage:
    if len(raw) != lay.raw_length:
        raise FormatError(f"`page.raw_length` {where}: expected {lay.raw_length}, got {len(raw)}",
                          field="page.raw_length", where=where)
    shape = (kv_heads, lay.tokens, head_dim)
    k = _codes(raw, 0, lay.codes_size, scheme.residual_bits, shape, where, "key_residual")
    v = _codes(raw, lay.codes_size, lay.codes_size, scheme.residual_bits, shape, where, "value_residual")
    return ResidualPage(k, v)


def stack_records(raws: list, lay: RecordLayout, scheme: Scheme, kv_heads: int, head_dim: int, *,
                  anchor: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Decode consecutive raw records of equal length (the full pages of one layer) in one vectorised pass.

    Returns (metadata ``[4, H, pages·nc, D]`` -- K offsets, K scales, V offsets, V scales -- or None for residual
    records, codes ``[2, H, pages·n, D]`` -- K, V), i.e. the pages concatenated along the token axis. Needs
    ``H·n·D·bits`` to be a multiple of 8, so that the code streams of consecutive records join into one stream
    without padding bits in between; :func:`stackable` says whether that holds.
    """
    pages, n, H, D = len(raws), lay.tokens, kv_heads, head_dim
    buf = np.frombuffer(bytearray(b"".join(raws)), dtype=np.uint8).reshape(pages, lay.raw_length)
    meta = None
    start = 0
    if anchor:
        nc = -(-n // scheme.chunk)
        start = 4 * lay.meta_size
        m = np.ascontiguousarray(buf[:, :start]).view(_META_NP[scheme.meta_dtype])
        m = m.astype(_META_NP[scheme.meta_dtype].newbyteorder("="), copy=False).reshape(pages, 4, H, nc, D)
        meta = torch.from_numpy(np.ascontiguousarray(m.transpose(1, 2, 0, 3, 4)).reshape(4, H, pages * nc, D))
        meta = meta.to(META_TORCH_DTYPE[scheme.meta_dtype])
    bits = scheme.anchor_bits if anchor else scheme.residual_bits
    stream = torch.from_numpy(np.ascontiguousarray(buf[:, start:start + 2 * lay.codes_size]).reshape(-1))
    codes = unpack_bits(stream, bits, pages * 2 * H * n * D).view(pages, 2, H, n, D)
    return meta, codes.permute(1, 2, 0, 3, 4).reshape(2, H, pages * n, D)


def stackable(lay: RecordLayout, scheme: Scheme, kv_heads: int, head_dim: int, *, anchor: bool) -> bool:
    bits = scheme.anchor_bits if anchor else scheme.residual_bits
    return kv_heads * lay.tokens * head_dim * bits % 8 == 0
