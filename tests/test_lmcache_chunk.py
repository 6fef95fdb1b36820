"""One LMCache chunk as lynx bytes (lynxkv.integrations.lmcache.chunk): no LMCache needed."""

from __future__ import annotations

import pytest
import torch

from lynxkv.cache import open_cache, verify_file
from lynxkv.errors import LynxError
from lynxkv.integrations.lmcache.chunk import (
    decode_chunk,
    encode_chunk,
    max_chunk_bytes,
    parse_layout,
    split_chunk,
    split_segments,
)
from lynxkv.integrations.lmcache.source import name_fingerprint


def _chunk(layers=3, tokens=256, heads=2, dim=32, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, tokens, heads * dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_chunk_round_trip_equals_the_full_code(dtype):
    x = _chunk(dtype=dtype)
    single = encode_chunk(x, kv_heads=2, model_name="org/tiny-llama", cache_id=bytes(range(16)))
    assert len(single) <= max_chunk_bytes(tuple(x.shape))
    assert len(single) <= 0.6 * x.numel() * x.element_size()
    assert verify_file(single) == []
    with open_cache(single) as c:
        assert (c.header.kv_heads, c.header.head_dim, c.header.tokens) == (2, 32, 256)
        assert c.header.fingerprint == name_fingerprint("org/tiny-llama")
        full = c.load_kv(dtype=dtype)
    out = decode_chunk(single, torch.empty_like(x))
    for i, (k, v) in enumerate(full):  # [H, T, D] -> the chunk's [T, H*D]
        assert torch.equal(out[0, i], k.permute(1, 0, 2).reshape(256, -1))
        assert torch.equal(out[1, i], v.permute(1, 0, 2).reshape(256, -1))
    assert (out.float() - x.float()).abs().max() < 0.05


def test_split_gives_an_anchor_and_a_residual_file_that_verify_and_decode_the_same():
    x = _chunk(tokens=300)  # a short second page too
    single = encode_chunk(x, kv_heads=1)
    anchor, residual = split_chunk(single, "obj.lynxr")
    assert verify_file(anchor, residual=residual) == []
    with open_cache(anchor) as c:
        assert c.info.residual_location == "obj.lynxr"
        anchor_only = c.load_kv(anchor_only=True)  # the anchor alone, no residual needed
    with open_cache(single) as c:
        ref_anchor = c.load_kv(anchor_only=True)
    assert all(torch.equal(a, b) for pa, pb in zip(anchor_only, ref_anchor) for a, b in zip(pa, pb))
    assert torch.equal(decode_chunk(anchor + residual, torch.empty_like(x)), decode_chunk(single, torch.empty_like(x)))


def test_any_even_leading_layout_round_trips_in_place():
    x = _chunk(layers=2).reshape(4, 256, 64)  # e.g. [2*layers, tokens, channels]
    out = torch.empty_like(x)
    decode_chunk(encode_chunk(x, kv_heads=2), out)
    assert (out.float() - x.float()).abs().max() < 0.05
    with pytest.raises(LynxError, match="even"):
        encode_chunk(torch.zeros(3, 256, 64))


def test_a_corrupted_chunk_raises_and_writes_nothing():
    x = _chunk()
    anchor, residual = split_chunk(encode_chunk(x), "obj.lynxr")
    bad = bytearray(residual)
    bad[-5] ^= 0x40  # inside the last residual page
    out = torch.zeros_like(x)
    with pytest.raises(LynxError, match="crc32"):
        decode_chunk(anchor + bytes(bad), out)
    assert not out.any()
    with pytest.raises(LynxError, match="shape|buffer"):
        decode_chunk(anchor + residual, torch.empty(2, 3, 128, 64, dtype=torch.float16))


def _vllm_cpu_object(k, v, block):
    """What LMCache gathers from vLLM's CPU attention (VEC kernels) for K, V ``[L, H, T, D]``: each layer's paged
    cache ``[blocks, H, block, 2*D]`` holds per block and head the keys column-major ``[D, block]``, then the values
    row-major ``[block, D]``; LMCache copies ``cache[blk, h, s, :]`` to the object's ``[blk*block + s, h*2D:]``."""
    layers, heads, tokens, d = k.shape
    obj = torch.empty(layers, tokens, heads * 2 * d, dtype=k.dtype)
    for layer in range(layers):
        cache = torch.empty(tokens // block, heads, block, 2 * d, dtype=k.dtype)
        for blk in range(tokens // block):
            for h in range(heads):
                mem = cache[blk, h].view(-1)
                mem[:d * block] = k[layer, h, blk * block:(blk + 1) * block].T.reshape(-1)  # K[dim, slot]
                mem[d * block:] = v[layer, h, blk * block:(blk + 1) * block].reshape(-1)  # V[slot, dim]
                obj[layer, blk * block:(blk + 1) * block, h * 2 * d:(h + 1) * 2 * d] = cache[blk, h]
    return obj


def test_a_vllm_cpu_chunk_is_stored_as_the_models_layers_and_round_trips_to_the_full_code():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 2, 256, 32, generator=g)  # 2 layers x 2 KV heads x 256 tokens x 32
    obj = _vllm_cpu_object(k, v, 32)
    layout = parse_layout("vllm-cpu-vec:32")
    single = encode_chunk(obj, kv_heads=2, layout=layout)
    assert len(single) <= max_chunk_bytes(tuple(obj.shape), kv_heads=2, layout=layout)
    assert len(single) <= 0.6 * obj.numel() * 2  # the fp16 size of the same KV
    with open_cache(single) as c:
        assert (c.header.layers, c.header.kv_heads, c.header.tokens, c.header.head_dim) == (2, 2, 256, 32)
        assert c.info.properties == {"lynxkv.lmcache_layout": "vllm-cpu-vec:32"}
        full = c.load_kv(dtype=torch.float32)
    for layer, (fk, fv) in enumerate(full):  # the model's own K and V, to the code's precision
        assert (fk - k[layer]).abs().max() < 0.05 and (fv - v[layer]).abs().max() < 0.05
    out = decode_chunk(single, torch.empty_like(obj))  # back in the engine's layout, exactly the full code
    assert torch.equal(out, _vllm_cpu_object(torch.stack([p[0] for p in full]), torch.stack([p[1] for p in full]), 32))
    with pytest.raises(LynxError, match="blocks"):
        encode_chunk(obj[:, :250], kv_heads=2, layout=layout)
    with pytest.raises(LynxError, match="layout"):
        parse_layout("vllm-cpu-amx:32")
    with pytest.raises(LynxError, match="shape|buffer"):  # a stored vLLM chunk does not fill a split-K/V buffer
        decode_chunk(single, torch.empty(2, 2, 256, 64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_a_chunk_with_its_exact_segment_decodes_bit_for_bit(dtype):
    """Format 1.4: with ``exact`` the single file carries the chunk's exact segment; split_segments puts it in a
    third file; either form decodes, with ``exact=True``, to the stored chunk bit for bit (the full code does not)."""
    x = _chunk(tokens=300, dtype=dtype)
    single = encode_chunk(x, kv_heads=2, exact=True)
    assert len(single) <= max_chunk_bytes(tuple(x.shape), kv_heads=2, exact=True)
    assert len(single) > len(encode_chunk(x, kv_heads=2))  # the exact segment rides along
    anchor, residual, exact = split_segments(single, "obj.lynxr", "cold/obj.lynxe")
    assert exact is not None and verify_file(anchor, residual=residual, exact=exact) == []
    with open_cache(anchor) as c:
        assert c.info.exact_location == "cold/obj.lynxe" and c.info.anchor_bytes == len(anchor)
    for data in (single, anchor + residual + exact):
        out = decode_chunk(data, torch.empty_like(x), exact=True)
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    full = decode_chunk(anchor + residual + exact, torch.empty_like(x))
    assert not torch.equal(full.view(torch.uint8), x.view(torch.uint8))
    assert split_chunk(single, "obj.lynxr")[0] != anchor  # without an exact location it stays inline


def test_a_chunk_with_a_corrupt_or_missing_exact_segment_writes_nothing():
    x = _chunk(dtype=torch.bfloat16)
    anchor, residual, exact = split_segments(encode_chunk(x, exact=True), "obj.lynxr", "obj.lynxe")
    bad = bytearray(exact)
    bad[-2] ^= 0x04
    out = torch.zeros_like(x)
    with pytest.raises(LynxError, match="crc32"):
        decode_chunk(anchor + residual + bytes(bad), out, exact=True)
    with pytest.raises(LynxError, match="exact bytes after the anchor"):
        decode_chunk(anchor + residual, out, exact=True)
    with pytest.raises(LynxError, match="no exact segment"):
        decode_chunk(encode_chunk(x), out, exact=True)
    assert not out.any()
