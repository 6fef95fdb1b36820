"""One LMCache chunk as lynx bytes, and back. No LMCache import: this is plain lynxkv.

LMCache stores KV in chunks of 256 tokens, each a tensor ``[2, layers, tokens, kv_heads * head_dim]`` (keys, then
values; fp16 or bf16). :func:`encode_chunk` makes one single-file ``.lynx`` cache of it (a valid cache on its own:
what the ``lynx`` serde hands to any LMCache tier); :func:`split_chunk` turns that file into an anchor file and a
residual file (what the lynx tier stores on two paths); :func:`decode_chunk` reads either form back into a
chunk tensor, exactly the full code's values (:func:`lynxkv.open_cache` ``.load_kv()``), every CRC checked.
"""

from __future__ import annotations

import torch

from lynxkv.errors import FormatError, InputError
from lynxkv.format import constants as c
from lynxkv.format.reader import read_anchor_header
from lynxkv.quant.scheme import DEFAULT, Scheme
from lynxkv.storage import BytesSource
from lynxkv.stream.lmcache_source import name_fingerprint


def as_pairs(shape) -> tuple[int, int, int, int]:
    """The ``[2, L, T, C]`` view of a chunk: ``[2, L, T, C]`` itself, or any ``[..., T, C]`` whose leading
    dimensions hold an even number of ``[T, C]`` slices (the first half taken as keys). Any such view decodes back
    to the same positions; only the quantizer's grouping (per channel, along tokens) depends on it."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 3:
        raise InputError(f"LMCache chunk: expected [..., tokens, channels], got {list(shape)}")
    lead = 1
    for d in shape[:-2]:
        lead *= d
    if lead % 2 or lead == 0:
        raise InputError(f"LMCache chunk {list(shape)}: the leading dimensions hold {lead} [tokens, channels] "
                         "slices; the lynx serde needs keys and values, an even number")
    return 2, lead // 2, shape[-2], shape[-1]


def chunk_to_kv(chunk: torch.Tensor, kv_heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[2, L, T, H*D]`` (see :func:`as_pairs`) -> per layer (K, V), each ``[H, T, D]``."""
    _, layers, tokens, channels = as_pairs(chunk.shape)
    chunk = chunk.reshape(2, layers, tokens, channels)
    if kv_heads < 1 or channels % kv_heads:
        raise InputError(f"LMCache chunk: {channels} channels do not split into {kv_heads} KV heads")
    d = channels // kv_heads

    def heads(x: torch.Tensor) -> torch.Tensor:  # [T, H*D] -> [H, T, D]
        return x.reshape(tokens, kv_heads, d).permute(1, 0, 2).contiguous()

    return [(heads(chunk[0, i]), heads(chunk[1, i])) for i in range(layers)]


def encode_chunk(chunk: torch.Tensor, *, kv_heads: int = 1, scheme: Scheme = DEFAULT, model_name: str = "",
                 cache_id: bytes | None = None) -> bytes:
    """One chunk as a single-file ``.lynx`` cache. The header's fingerprint is the model's :func:`~lynxkv.stream.lmcache_source.name_fingerprint` of
    ``model_name`` (the name itself is in the object's key and file name)."""
    from lynxkv.cache import encode_kv
    from lynxkv.format.writer import build_files

    kv = chunk_to_kv(chunk.detach().to("cpu"), kv_heads)
    scheme = scheme.replace(sink_tokens=0)  # chunks are joined into one cache (lynxkv.stream.joined): no sinks
    enc = encode_kv(kv, scheme, model_fingerprint=name_fingerprint(model_name) if model_name else None)
    return build_files(enc, cache_id=cache_id, single_file=True).anchor


def split_chunk(single: bytes, residual_location: str) -> tuple[bytes, bytes]:
    """A single-file cache -> (anchor file recording its residual at ``residual_location``, residual file)."""
    from lynxkv.stream.tier import relocate_residual

    h = read_anchor_header(BytesSource(single, "chunk"))
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None or seg.placement != c.PLACEMENT_INLINE:
        raise InputError("split_chunk: expected a single-file cache")
    return relocate_residual(single, residual_location), single[seg.offset:seg.offset + seg.length]


def anchor_length(data: bytes) -> int:
    """Bytes of the anchor file at the start of ``data`` (which may be followed by its residual file)."""
    h = read_anchor_header(BytesSource(data, "chunk"), exact_size=False)
    return h.segments[0].offset + sum(s.length for s in h.segments
                                      if s.placement == c.PLACEMENT_INLINE)


def open_chunk(data: bytes):
    """Open ``data`` (a single-file cache, or an anchor file followed by its residual file) as a LynxCache."""
    from lynxkv.cache import open_cache

    n = anchor_length(data)
    h = read_anchor_header(BytesSource(bytes(data[:n]), "anchor"))
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is not None and seg.placement == c.PLACEMENT_EXTERNAL:
        if len(data) < n + seg.length:
            raise FormatError(f"chunk: {len(data) - n} residual bytes after the anchor, expected {seg.length}",
                              field="length", where="residual")
        return open_cache(bytes(data[:n]), residual=bytes(data[n:n + seg.length]))
    return open_cache(bytes(data[:n]))


def decode_chunk(data: bytes, out: torch.Tensor, *, anchor_only: bool = False) -> torch.Tensor:
    """Fill ``out`` (a chunk tensor, see :func:`as_pairs`) with the chunk stored in ``data``; shapes must match."""
    with open_chunk(data) as cache:
        h = cache.header
        want = (2, h.layers, h.tokens, h.kv_heads * h.head_dim)
        if as_pairs(out.shape) != want:
            raise FormatError(f"chunk: the stored cache is {list(want)}, the buffer is {list(out.shape)}",
                              field="shape")
        kv = cache.load_kv(anchor_only=anchor_only, dtype=out.dtype)
    pairs = out.view(want)
    for i, (k, v) in enumerate(kv):
        pairs[0, i].copy_(k.permute(1, 0, 2).reshape(h.tokens, -1))
        pairs[1, i].copy_(v.permute(1, 0, 2).reshape(h.tokens, -1))
    return out


def max_chunk_bytes(shape: tuple[int, ...], scheme: Scheme = DEFAULT) -> int:
    """An upper bound on :func:`encode_chunk`'s output for a chunk of ``shape`` (what LMCache allocates)."""
    _, layers, tokens, channels = as_pairs(shape)
    elements = 2 * layers * tokens * channels
    chunks = -(-tokens // scheme.chunk)
    meta = 2 * layers * channels * chunks * 2 * 4  # offset + scale per channel and chunk, for K and V, <= 4 bytes
    pages = -(-tokens // scheme.page) * layers
    codes = -(-elements * (scheme.anchor_bits + scheme.residual_bits) // 8)
    return codes + meta + pages * 2 * 64 + 64 * 1024  # page index entries and headers, generously
