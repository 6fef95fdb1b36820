"""The ``lynx`` serde for LMCache tiers: each chunk stored as one single-file ``.lynx`` cache.

Importing this module registers the serde type ``"lynx"`` (``register_serde_factory``). Any LMCache L2 tier can
use it (``"serde": {"type": "lynx", "kv_heads": 8}``); the stored object is then a valid ``.lynx`` file that
``lynxkv inspect``/``verify``/``decode`` read, at ~9 bits per element instead of 16. Options: ``kv_heads`` (how
the chunk's ``kv_heads*head_dim`` channels split into heads; 1 keeps them as one head, which quantizes
identically), ``layout`` (how the chunk tensor holds K and V, :class:`~lynxkv.integrations.lmcache.chunk.ChunkLayout`:
``kv``, the default, for LMCache's split-K/V objects; ``vllm-cpu-vec:B`` for vLLM's CPU build with KV block size
``B``, whose objects LMCache gathers as ``[layers, tokens, kv_heads * 2 * head_dim]`` blocks of that backend's raw
memory: the lynx object is then a cache of the model's layers, heads and head dim), ``scheme`` (a lynxkv scheme
name, default ``default``; stored without sink tokens, :func:`~lynxkv.integrations.lmcache.chunk.chunk_scheme`),
``exact`` (each object also carries the chunk's exact segment, and deserializing gives the chunk back
bit for bit instead of the full code's values; an object without one is then refused), ``max_workers``.

A deserialize failure fails LMCache's whole load batch; the lynx tier (``adapter.py``) therefore checks every CRC
per chunk before it reports a hit, so that a corrupted object is a miss for that chunk only.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

from lynxkv.errors import InputError
from lynxkv.integrations.lmcache.chunk import (ChunkLayout, chunk_scheme, decode_chunk, encode_chunk,
                                              max_chunk_bytes, parse_flag, parse_layout)
from lynxkv.quant.scheme import Scheme, get_scheme
from lynxkv.integrations.lmcache.source import key_cache_id

SERDE_TYPE = "lynx"


class LynxSerializer(Serializer):
    def __init__(self, kv_heads: int = 1, scheme: Scheme | None = None, layout: ChunkLayout = ChunkLayout(),
                 exact: bool = False):
        self.kv_heads, self.scheme, self.layout = kv_heads, chunk_scheme(scheme or get_scheme()), layout
        self.exact = exact

    def serialize(self, src, dst, key: ObjectKey) -> int:
        data = encode_chunk(src.tensor, kv_heads=self.kv_heads, scheme=self.scheme, model_name=key.model_name,
                            cache_id=key_cache_id(key), layout=self.layout, exact=self.exact)
        buf = memoryview(dst.byte_array).cast("B")
        if len(data) > len(buf):
            raise InputError(f"lynx serde: {len(data)} bytes do not fit the {len(buf)}-byte buffer")
        buf[:len(data)] = data
        return len(data)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        if len(layout_desc.shapes) != 1:
            raise InputError(f"lynx serde: expected one KV tensor per chunk, got {len(layout_desc.shapes)}")
        return max_chunk_bytes(tuple(layout_desc.shapes[0]), self.scheme, kv_heads=self.kv_heads, layout=self.layout,
                               exact=self.exact)


class LynxDeserializer(Deserializer):
    def __init__(self, exact: bool = False):
        self.exact = exact

    def deserialize(self, src, dst, key: ObjectKey) -> None:
        decode_chunk(bytes(memoryview(src.byte_array).cast("B")), dst.tensor, exact=self.exact)


def create_lynx_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    scheme = get_scheme(str(kwargs.get("scheme", "default")))
    layout = parse_layout(str(kwargs.get("layout", "kv")))
    exact = parse_flag(kwargs.get("exact", False))
    return AsyncSerdeProcessor(LynxSerializer(int(kwargs.get("kv_heads", 1)), scheme, layout, exact),
                               LynxDeserializer(exact), max_workers=int(kwargs.get("max_workers", 1)))


if SERDE_TYPE not in get_registered_serde_types():
    register_serde_factory(SERDE_TYPE, create_lynx_serde)
