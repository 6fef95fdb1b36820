"""save -> open -> load_kv equals dequantize(quantize(x)) exactly, on awkward shapes, both layouts, both codecs."""

from __future__ import annotations

import io

import pytest
import torch

from lynxkv.cache import encode_kv, open_cache, save_cache
from lynxkv.errors import InputError, LynxError
from lynxkv.format.reader import BytesSource
from lynxkv.format.writer import build_files
from lynxkv.quant import dequantize, quantize
from lynxkv.scheme import DEFAULT, PAPER, Scheme


def make_kv(layers: int, heads: int, tokens: int, dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, tokens, dim, generator=g).to(dtype) * 3 + 1,
             torch.randn(heads, tokens, dim, generator=g).to(dtype)) for _ in range(layers)]


def expected(kv, scheme, anchor_only, dtype=None):
    return [tuple(dequantize(quantize(t, scheme), scheme, anchor_only=anchor_only, dtype=dtype or t.dtype)
                  for t in pair) for pair in kv]


def assert_kv_equal(got, want):
    assert len(got) == len(want)
    for layer, ((gk, gv), (wk, wv)) in enumerate(zip(got, want)):
        assert gk.dtype == wk.dtype and gk.shape == wk.shape, f"layer {layer}"
        assert torch.equal(gk, wk), f"layer {layer} keys differ"
        assert torch.equal(gv, wv), f"layer {layer} values differ"


CASES = [
    # id, heads, tokens, dim, dtype, single_file, zstd, scheme
    ("T1-fp32-two-file", 2, 1, 8, torch.float32, False, False, DEFAULT),
    ("T31-one-head-zstd", 1, 31, 8, torch.float32, False, True, DEFAULT),
    ("T257-single-file", 2, 257, 4, torch.float32, True, False, DEFAULT),
    ("T257-single-zstd-fp16", 2, 257, 4, torch.float16, True, True, DEFAULT),
    ("T1000-bf16-zstd", 1, 1000, 4, torch.bfloat16, False, True, DEFAULT),
    ("T1000-paper-fp16", 2, 1000, 4, torch.float16, False, False, PAPER),
    ("T33-5+3-fp32-meta-P64", 3, 33, 5, torch.float32, True, True,
     Scheme(chunk=16, page=64, anchor_bits=5, residual_bits=3, meta_dtype="fp32")),
    ("T0-empty", 2, 0, 4, torch.float32, False, False, DEFAULT),
]


@pytest.mark.parametrize("heads,tokens,dim,dtype,single,zstd,scheme", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_roundtrip_equals_reference(tmp_path, heads, tokens, dim, dtype, single, zstd, scheme):
    kv = make_kv(2, heads, tokens, dim, dtype)
    path = tmp_path / "c.lynx"
    info = save_cache(path, kv, scheme, single_file=single, zstd=zstd, prompt_token_ids=[5, 6, 7],
                      model_fingerprint="0123456789abcdef0123456789abcdef")
    assert (tmp_path / "c.lynxr").exists() != single
    assert info.tokens == tokens and info.layers == 2 and info.kv_heads == heads and info.head_dim == dim
    assert info.scheme == scheme and info.residual_inline == single
    with open_cache(path) as cache:
        assert cache.info.prompt_token_ids == [5, 6, 7]
        assert cache.info.model_fingerprint == "0123456789abcdef0123456789abcdef"
        assert cache.residual_reachable()
        assert cache.verify() == []
        assert_kv_equal(cache.load_kv(), expected(kv, scheme, False))
        assert_kv_equal(cache.load_kv(anchor_only=True), expected(kv, scheme, True))
        assert_kv_equal(cache.load_kv(dtype=torch.float32), expected(kv, scheme, False, torch.float32))


def test_page_random_access_matches_encoded_slices():
    scheme = Scheme(page=64)
    kv = make_kv(3, 2, 150, 4)
    enc = encode_kv(kv, scheme)
    built = build_files(enc, cache_id=bytes(16), zstd=True, residual_location="r.lynxr")
    with open_cache(built.anchor, residual=built.residual) as cache:
        assert cache.info.pages_per_layer == 3
        for layer in (0, 2):
            for p, (t0, t1) in enumerate([(0, 64), (64, 128), (128, 150)]):
                k = enc.layers[layer][0].tokens(t0, t1, scheme.chunk)
                a = cache.read_anchor_page(layer, p)
                r = cache.read_residual_page(layer, p)
                assert torch.equal(a.key_anchor, k.anchor) and torch.equal(a.key_scale, k.scale)
                assert torch.equal(a.key_offset, k.offset) and torch.equal(r.key_residual, k.residual)
        with pytest.raises(InputError):
            cache.read_anchor_page(3, 0)


def test_file_object_and_bytes_sources_read_the_same(tmp_path):
    kv = make_kv(2, 1, 40, 4)
    path = tmp_path / "c.lynx"
    save_cache(path, kv, single_file=True)
    data = path.read_bytes()
    want = expected(kv, DEFAULT, False)
    for source in (data, io.BytesIO(data), BytesSource(data)):
        with open_cache(source) as cache:
            assert_kv_equal(cache.load_kv(), want)


def test_tensor_names_batch_dim_and_custom_residual_path(tmp_path):
    kv = [(k[None], v[None]) for k, v in make_kv(2, 2, 10, 4)]  # [1, H, T, D]
    names = ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    (tmp_path / "far").mkdir()
    save_cache(tmp_path / "a.lynx", kv, names=names, residual_path=tmp_path / "far" / "a.res")
    with open_cache(tmp_path / "a.lynx") as cache:
        assert cache.info.names == tuple(names) and cache.info.batch_dim
        assert cache.info.residual_location == "far/a.res"
        assert cache.residual_reachable()
    (tmp_path / "far" / "a.res").rename(tmp_path / "moved.res")
    with open_cache(tmp_path / "a.lynx") as cache:
        assert not cache.residual_reachable()
        assert cache.load_kv(anchor_only=True)[0][0].shape == (2, 10, 4)  # the anchor alone still works
        with pytest.raises(LynxError, match="does not exist"):
            cache.load_kv()
        assert [f.field for f in cache.verify()] == ["location"]
    with open_cache(tmp_path / "a.lynx", residual=tmp_path / "moved.res") as cache:
        assert cache.verify() == [] and len(cache.load_kv()) == 2


def test_quantize_fn_is_used():
    calls = []

    def spy(x, scheme):
        calls.append(tuple(x.shape))
        return quantize(x, scheme)

    encode_kv(make_kv(2, 1, 5, 4), quantize_fn=spy)
    assert calls == [(1, 5, 4)] * 4


@pytest.mark.parametrize("kv,match", [
    ([], "at least one layer"),
    ([(torch.zeros(2, 3), torch.zeros(2, 3))], "head_dim"),
    ([(torch.zeros(1, 3, 4), torch.zeros(1, 3, 5))], "differs"),
    ([(torch.zeros(1, 3, 4, dtype=torch.float64),) * 2], "dtype"),
    ([(torch.zeros(2, 1, 3, 4),) * 2], r"\[1, kv_heads"),
], ids=["no-layers", "2d", "shape-mismatch", "float64", "batch-2"])
def test_bad_input_is_one_clear_error(tmp_path, kv, match):
    with pytest.raises(InputError, match=match):
        save_cache(tmp_path / "x.lynx", kv)
    assert list(tmp_path.iterdir()) == []


def test_rewrite_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "c.lynx"
    save_cache(path, make_kv(1, 1, 8, 4, seed=1))
    save_cache(path, make_kv(1, 1, 8, 4, seed=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.lynx", "c.lynxr"]
    with open_cache(path) as cache:
        assert_kv_equal(cache.load_kv(), expected(make_kv(1, 1, 8, 4, seed=2), DEFAULT, False))
