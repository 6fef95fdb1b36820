"""One LMCache chunk as lynx bytes, and back. No LMCache import: this is plain lynxkv.

LMCache stores KV in chunks of 256 tokens. How a chunk tensor holds each layer's keys and values depends on the
engine's paged KV format (:class:`ChunkLayout`): ``kv``, LMCache's split-K/V object ``[2, layers, tokens,
kv_heads * head_dim]`` (fp16, bf16 or fp32), or ``vllm-cpu-vec:B``, the fused object ``[layers, tokens,
kv_heads * 2 * head_dim]`` that LMCache gathers from vLLM's CPU attention (each ``B``-token block and head is
that backend's raw memory: the keys as ``[head_dim, B]``, then the values as ``[B, head_dim]``).
:func:`encode_chunk` makes one single-file ``.lynx`` cache of it whose layers, heads and tokens are the model's
(a valid cache on its own: what the ``lynx`` serde hands to any LMCache tier; a non-default layout is recorded in
the header's ``lynxkv.lmcache_layout`` property); :func:`split_chunk` turns that file into an anchor file and a
residual file (what the lynx tier stores on two paths); :func:`decode_chunk` reads either form back into a
chunk tensor in the recorded layout, exactly the full code's values (:func:`lynxkv.open_cache` ``.load_kv()``),
every CRC checked. With ``exact`` the chunk also carries its exact segment (inline in the single
file, a third file after :func:`split_segments`), and :func:`decode_chunk` ``exact=True`` gives back the chunk
bit for bit in its own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynxkv.errors import FormatError, InputError
from lynxkv.format import constants as c
from lynxkv.format.reader import read_anchor_header
from lynxkv.quant.scheme import DEFAULT, Scheme
from lynxkv.storage import BytesSource
from lynxkv.integrations.lmcache.source import name_fingerprint


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


def chunk_scheme(scheme: Scheme) -> Scheme:
    """``scheme`` as a chunk is stored with it: no sink tokens. A chunk's first tokens are the sequence's only in
    its first chunk (the serde cannot tell which), and lmcache:// joins chunks along tokens, where only the joined
    cache's start may hold sinks (:func:`lynxkv.stream.joined.join_problem`)."""
    return scheme.replace(sink_tokens=0) if scheme.sink_tokens else scheme


DEFAULT_CHUNK = chunk_scheme(DEFAULT)
LAYOUT_PROPERTY = "lynxkv.lmcache_layout"  # header property: the chunk layout, when not the default ``kv``
VLLM_CPU_VEC = "vllm-cpu-vec"


@dataclass(frozen=True)
class ChunkLayout:
    """How a chunk tensor holds each layer's keys and values: ``kv`` (see :func:`as_pairs`) or ``vllm-cpu-vec``
    with the engine's KV block size (vLLM's CPU attention, VEC kernels: fp32/fp16 or bf16 without AMX, head and
    block sizes multiples of 32; its AMX, VEC16 and NEON kernels lay blocks out otherwise)."""

    name: str = "kv"
    block_size: int = 0

    def __str__(self) -> str:
        return f"{self.name}:{self.block_size}" if self.block_size else self.name

    def dims(self, shape, kv_heads: int) -> tuple[int, int, int, int]:
        """(layers, tokens, kv heads, head dim) of a chunk of ``shape``, checked against this layout."""
        shape = tuple(int(d) for d in shape)
        if self.name == "kv":
            _, layers, tokens, channels = as_pairs(shape)
            packed = 1
        else:
            if len(shape) != 3:
                raise InputError(f"LMCache chunk {list(shape)}: {self} expects [layers, tokens, heads * 2 * dim]")
            layers, tokens, channels = shape
            packed = 2
            if tokens % self.block_size:
                raise InputError(f"LMCache chunk: {tokens} tokens are not whole {self} blocks")
        if kv_heads < 1 or channels % (kv_heads * packed):
            raise InputError(f"LMCache chunk: {channels} channels do not split into {kv_heads} KV heads"
                             + (" of packed keys and values" if packed == 2 else ""))
        return layers, tokens, kv_heads, channels // (kv_heads * packed)


def parse_flag(value, what: str = "lynx serde: exact") -> bool:
    """A boolean option as JSON or a command line gives it (``true``, ``"true"``, ``1``; ``"false"`` is false): the
    serde's and the tier's ``exact``."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no", ""):
            raise InputError(f"{what}: expected true or false, got {value[:40]!r}")
        return value.lower() in ("true", "1", "yes")
    return bool(value)


def parse_layout(text: str) -> ChunkLayout:
    """``kv`` or ``vllm-cpu-vec:B`` (what the serde's ``layout`` option and the header property hold)."""
    name, _, block = str(text).partition(":")
    if name == "kv" and not block:
        return ChunkLayout()
    if name == VLLM_CPU_VEC and block.isdigit() and 0 < int(block) <= 1 << 16:
        return ChunkLayout(name, int(block))
    raise InputError(f"LMCache chunk layout {str(text)[:80]!r}: expected 'kv' or '{VLLM_CPU_VEC}:BLOCK_SIZE'")


def chunk_to_kv(chunk: torch.Tensor, kv_heads: int, layout: ChunkLayout = ChunkLayout()
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A chunk in ``layout`` -> per layer (K, V), each ``[H, T, D]``."""
    layers, tokens, heads, d = layout.dims(chunk.shape, kv_heads)
    if layout.name == "kv":
        x = chunk.reshape(2, layers, tokens, heads, d).permute(0, 1, 3, 2, 4)  # [2, L, H, T, D]
        return [(x[0, i].contiguous(), x[1, i].contiguous()) for i in range(layers)]
    b = layout.block_size
    raw = chunk.reshape(layers, tokens // b, b, heads, 2 * d).permute(0, 3, 1, 2, 4)  # [L, H, blocks, b, 2d]
    raw = raw.reshape(layers, heads, tokens // b, 2 * b * d)  # each block's memory for one head
    k = raw[..., :b * d].reshape(layers, heads, tokens // b, d, b).transpose(-1, -2).reshape(layers, heads, tokens, d)
    v = raw[..., b * d:].reshape(layers, heads, tokens, d)
    return [(k[i].contiguous(), v[i].contiguous()) for i in range(layers)]


def kv_to_chunk(kv, out: torch.Tensor, layout: ChunkLayout = ChunkLayout()) -> torch.Tensor:
    """Per layer (K, V) ``[H, T, D]`` -> ``out``, a chunk in ``layout`` (the inverse of :func:`chunk_to_kv`)."""
    layers, tokens, heads, d = layout.dims(out.shape, kv[0][0].shape[0])
    k = torch.stack([p[0] for p in kv]).to(out.dtype)  # [L, H, T, D]
    v = torch.stack([p[1] for p in kv]).to(out.dtype)
    if layout.name == "kv":
        out.view(2, layers, tokens, heads, d).copy_(torch.stack([k, v]).permute(0, 1, 3, 2, 4))
        return out
    b = layout.block_size
    raw = torch.cat([k.reshape(layers, heads, tokens // b, b, d).transpose(-1, -2).reshape(layers, heads, -1, b * d),
                     v.reshape(layers, heads, tokens // b, b * d)], -1)
    out.view(layers, tokens // b, b, heads, 2 * d).copy_(raw.reshape(layers, heads, tokens // b, b, 2 * d)
                                                         .permute(0, 2, 3, 1, 4))
    return out


def encode_chunk(chunk: torch.Tensor, *, kv_heads: int = 1, scheme: Scheme = DEFAULT_CHUNK, model_name: str = "",
                 cache_id: bytes | None = None, layout: ChunkLayout = ChunkLayout(), exact: bool = False) -> bytes:
    """One chunk (in ``layout``) as a single-file ``.lynx`` cache (``exact``: with its exact segment, 1.4). The
    header's fingerprint is the model's :func:`~lynxkv.integrations.lmcache.source.name_fingerprint` of
    ``model_name`` (the name itself is in the object's key and file name)."""
    from lynxkv.cache import encode_kv
    from lynxkv.format.writer import build_files

    kv = chunk_to_kv(chunk.detach().to("cpu"), kv_heads, layout)
    enc = encode_kv(kv, scheme, model_fingerprint=name_fingerprint(model_name) if model_name else None)
    if layout != ChunkLayout():
        enc.properties = {LAYOUT_PROPERTY: str(layout)}
    return build_files(enc, cache_id=cache_id, single_file=True, exact_kv=kv if exact else None).anchor


def split_chunk(single: bytes, residual_location: str) -> tuple[bytes, bytes]:
    """A single-file cache -> (anchor file recording its residual at ``residual_location``, residual file); an
    inline exact segment stays in the anchor file (:func:`split_segments` puts it in a file of its own)."""
    anchor, residual, _ = split_segments(single, residual_location)
    return anchor, residual


def split_segments(single: bytes, residual_location: str, exact_location: str | None = None
                   ) -> tuple[bytes, bytes, bytes | None]:
    """A single-file cache -> (anchor file, residual file, exact file or None): the anchor records its residual
    at ``residual_location`` and, with ``exact_location``, its exact segment there (an inline exact segment
    otherwise stays inline). Each file is its section byte for byte."""
    from lynxkv.stream.tier import relocate_segments

    h = read_anchor_header(BytesSource(single, "chunk"))
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None or seg.placement != c.PLACEMENT_INLINE:
        raise InputError("split_chunk: expected a single-file cache")
    locations = {c.SEGMENT_RESIDUAL: residual_location}
    ex = h.segment(c.SEGMENT_EXACT)
    exact = None
    if exact_location is not None and ex is not None and ex.placement == c.PLACEMENT_INLINE:
        locations[c.SEGMENT_EXACT] = exact_location
        exact = single[ex.offset:ex.offset + ex.length]
    return relocate_segments(single, locations), single[seg.offset:seg.offset + seg.length], exact


def anchor_length(data: bytes) -> int:
    """Bytes of the anchor file at the start of ``data`` (which may be followed by its residual file)."""
    h = read_anchor_header(BytesSource(data, "chunk"), exact_size=False)
    return h.segments[0].offset + sum(s.length for s in h.segments
                                      if s.placement == c.PLACEMENT_INLINE)


def open_chunk(data: bytes):
    """Open ``data`` (a single-file cache, or an anchor file followed by its residual file, and by its exact file
    when it records one of its own) as a LynxCache."""
    from lynxkv.cache import open_cache

    n = anchor_length(data)
    h = read_anchor_header(BytesSource(bytes(data[:n]), "anchor"))
    files, at = {}, n
    for kind, name in ((c.SEGMENT_RESIDUAL, "residual"), (c.SEGMENT_EXACT, "exact")):
        seg = h.segment(kind)
        if seg is not None and seg.placement == c.PLACEMENT_EXTERNAL:
            if len(data) < at + seg.length:
                raise FormatError(f"chunk: {max(len(data) - at, 0)} {name} bytes after the anchor, expected "
                                  f"{seg.length}", field="length", where=name)
            files[name], at = bytes(data[at:at + seg.length]), at + seg.length
    return open_cache(bytes(data[:n]), **files)


def decode_chunk(data: bytes, out: torch.Tensor, *, anchor_only: bool = False, exact: bool = False) -> torch.Tensor:
    """Fill ``out`` (a chunk tensor in the layout the header records) with the chunk stored in ``data``; its
    layers, tokens, heads and head dim must match. ``exact``: the stored chunk bit for bit, from its exact
    segment (``out`` in the chunk's own dtype; every page checked before ``out`` is written)."""
    with open_chunk(data) as cache:
        h = cache.header
        try:
            layout = parse_layout(cache.info.properties.get(LAYOUT_PROPERTY, "kv"))
            dims = layout.dims(out.shape, h.kv_heads)
        except InputError as e:
            raise FormatError(f"chunk: the buffer {list(out.shape)} does not take the stored cache: {e}",
                              field="shape") from None
        if dims != (h.layers, h.tokens, h.kv_heads, h.head_dim):
            raise FormatError(f"chunk: the stored cache is {h.layers} layers x {h.tokens} tokens x {h.kv_heads} "
                              f"heads x {h.head_dim} ({layout}), the buffer is {list(out.shape)}", field="shape")
        kv = cache.load_kv(anchor_only=anchor_only, dtype=out.dtype, exact=exact)
    return kv_to_chunk(kv, out, layout)


def max_chunk_bytes(shape: tuple[int, ...], scheme: Scheme = DEFAULT_CHUNK, *, kv_heads: int = 1,
                    layout: ChunkLayout = ChunkLayout(), exact: bool = False) -> int:
    """An upper bound on :func:`encode_chunk`'s output for a chunk of ``shape`` (what LMCache allocates);
    ``exact``: with its exact segment, which stores at most the chunk's own bytes (fp32 at most) plus headers."""
    layers, tokens, heads, d = layout.dims(shape, kv_heads)
    channels = heads * d
    elements = 2 * layers * tokens * channels
    chunks = -(-tokens // scheme.chunk)
    meta = 2 * layers * channels * chunks * 2 * 4  # offset + scale per channel and chunk, for K and V, <= 4 bytes
    pages = -(-tokens // scheme.page) * layers
    codes = -(-elements * (scheme.anchor_bits + scheme.residual_bits) // 8)
    exact_bytes = elements * 4 + pages * 2 * 64 + 64 * 1024 if exact else 0
    return codes + meta + pages * 2 * 64 + 64 * 1024 + exact_bytes  # page index entries and headers, generously
