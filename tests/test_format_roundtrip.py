"""save -> open -> load_kv equals dequantize(quantize(x)) exactly, on awkward shapes, both layouts, both codecs."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
import torch

from lynxkv.cache import encode_kv, open_cache, save_cache
from lynxkv.errors import FormatError, InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.storage import BytesSource
from lynxkv.format.writer import build_files
from lynxkv.quant import dequantize, quantize
from lynxkv.quant.scheme import DEFAULT, PAPER, Scheme


def make_kv(layers: int, heads: int, tokens: int, dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, tokens, dim, generator=g).to(dtype) * 3 + 1,
             torch.randn(heads, tokens, dim, generator=g).to(dtype)) for _ in range(layers)]


def expected(kv, scheme, anchor_only, dtype=None):
    return [tuple(dequantize(quantize(t, scheme, kind), scheme, anchor_only=anchor_only, dtype=dtype or t.dtype)
                  for t, kind in zip(pair, ("key", "value"))) for pair in kv]


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
    ("T5-P1-3+5-odd-bit-pages", 1, 5, 3, torch.float32, False, True,
     Scheme(chunk=1, page=1, anchor_bits=3, residual_bits=5)),
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


def test_encode_kv_gives_the_reference_codes():
    from lynxkv.quant import reference

    kv = make_kv(2, 1, 37, 4)
    enc = encode_kv(kv)
    for (k, v), (ek, ev) in zip(kv, enc.layers):
        for x, e, kind in ((k, ek, "key"), (v, ev, "value")):
            ref = reference.quantize(x, enc.scheme, kind)
            assert all(torch.equal(getattr(ref, f), getattr(e, f)) for f in ("anchor", "residual", "offset", "scale"))


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
    """Replacing a two-file cache: the new residual goes under a fresh name, the anchor last, the old residual
    is removed after; each rewrite leaves exactly one anchor and the residual it records."""
    path = tmp_path / "c.lynx"
    save_cache(path, make_kv(1, 1, 8, 4, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.lynx", "c.lynxr"]
    for seed in (2, 3):
        save_cache(path, make_kv(1, 1, 8, 4, seed=seed))
        with open_cache(path) as cache:
            names = sorted(p.name for p in tmp_path.iterdir())
            assert names == sorted(["c.lynx", cache.info.residual_location]), names
            assert cache.verify() == []
    save_cache(path, make_kv(1, 1, 8, 4, seed=4), single_file=True)  # the old residual goes with it
    assert [p.name for p in tmp_path.iterdir()] == ["c.lynx"]
    with open_cache(path) as cache:
        assert_kv_equal(cache.load_kv(), expected(make_kv(1, 1, 8, 4, seed=4), DEFAULT, False))


def test_byte_range_steps_without_a_source():
    """What a transport does: fetch byte ranges itself and call the three public steps on the bytes."""
    from lynxkv.format import (PREFIX_SIZE, anchor_header_length, decode_page, index_span, parse_anchor_header,
                               parse_residual_header, parse_section_index)
    from lynxkv.format import constants as c
    from lynxkv.format.section_headers import check_residual_matches

    kv = make_kv(2, 2, 300, 4)
    enc = encode_kv(kv)
    built = build_files(enc, cache_id=bytes(16), residual_location="r.lynxr")
    a, r = built.anchor, built.residual
    fetched = []

    def fetch(blob, offset, length):
        fetched.append((offset, length))
        return blob[offset:offset + length]

    h = parse_anchor_header(fetch(a, 0, anchor_header_length(fetch(a, 0, PREFIX_SIZE))))
    lead, size = index_span(h, c.SEGMENT_ANCHOR)
    base = h.segments[0].offset
    aidx = parse_section_index(fetch(a, base + lead, size), h, c.SEGMENT_ANCHOR, base=base)
    rh = parse_residual_header(fetch(r, 0, c.RESIDUAL_HEADER_SIZE))
    check_residual_matches(h, rh)
    lead, size = index_span(h, c.SEGMENT_RESIDUAL)
    ridx = parse_section_index(fetch(r, lead, size), h, c.SEGMENT_RESIDUAL, base=0, residual_header=rh)
    off, n = aidx.span(1, 1)
    page = decode_page(fetch(a, off, n), aidx.entry(1, 1), h, c.SEGMENT_ANCHOR, 1, 1)
    off, n = ridx.span(1, 1)
    rpage = decode_page(fetch(r, off, n), ridx.entry(1, 1), h, c.SEGMENT_RESIDUAL, 1, 1)
    want = enc.layers[1][1].tokens(256, 300, 32)
    assert torch.equal(page.value_anchor, want.anchor) and torch.equal(rpage.value_residual, want.residual)
    assert sum(n for _, n in fetched) < len(a) // 2 + len(r) // 2  # only what was asked for was read


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    import os

    path = tmp_path / "c.lynx"
    save_cache(path, make_kv(1, 1, 8, 4, seed=1), single_file=True)
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(LynxError, match="cannot write"):
        save_cache(path, make_kv(1, 1, 8, 4, seed=2), single_file=True)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.lynx"]


def test_bits_per_element_at_default_scheme_on_a_smollm2_shaped_cache():
    """P=256, C=32, fp16 metadata: <= 9.1 bits per element in all and <= 5.1 for the anchor file, headers and
    indexes included (1000 tokens: the last chunk is short, as for a real prompt)."""
    built = build_files(encode_kv(make_kv(2, 3, 1000, 64)), cache_id=bytes(16), residual_location="r")
    with open_cache(built.anchor, residual=built.residual) as cache:
        bits = cache.info.bits_per_element
        assert bits["anchor"] == pytest.approx(8 * len(built.anchor) / (2 * 2 * 3 * 1000 * 64))
        assert bits["total"] == pytest.approx(8 * (len(built.anchor) + len(built.residual)) / (2 * 2 * 3 * 1000 * 64))
        assert 9.0 < bits["total"] <= 9.1 and 5.0 < bits["anchor"] <= 5.1
        assert (bits["total_codes"], bits["anchor_codes"]) == (8.0, 4.0)
        assert cache.info.anchor_bytes == len(built.anchor) and cache.info.residual_bytes == len(built.residual)


def test_verify_file_reports_a_missing_residual_and_a_damaged_anchor(tmp_path):
    from lynxkv.cache import verify_file

    path = tmp_path / "c.lynx"
    save_cache(path, make_kv(2, 1, 40, 4))
    assert verify_file(path) == []
    (tmp_path / "c.lynxr").unlink()
    assert [f.field for f in verify_file(path)] == ["location"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    found = verify_file(path, residual=b"")
    assert [(f.segment, f.field, f.layer, f.page) for f in found][0] == ("anchor", "page.crc32", 1, 0)
    assert found[1].segment == "residual"


def test_file_object_residual_is_left_open_for_its_owner(tmp_path):
    kv = make_kv(1, 1, 20, 4)
    save_cache(tmp_path / "c.lynx", kv)
    with open(tmp_path / "c.lynxr", "rb") as f:
        with open_cache(tmp_path / "c.lynx", residual=f) as cache:
            assert cache.verify() == []
            assert_kv_equal(cache.load_kv(), expected(kv, DEFAULT, False))
        assert not f.closed


def test_bad_fingerprint_is_refused_by_the_writer(tmp_path):
    with pytest.raises(InputError, match="model_fingerprint"):
        save_cache(tmp_path / "x.lynx", make_kv(1, 1, 4, 4), model_fingerprint="not-a-fingerprint")
    assert list(tmp_path.iterdir()) == []


def test_roundtrip_property():
    """Random shapes, schemes and layouts: the file stores exactly the encoded codes and metadata."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None)
    @given(heads=st.integers(1, 3), tokens=st.integers(0, 70), dim=st.integers(1, 6), layers=st.integers(1, 2),
           chunk_log=st.integers(0, 3), pages_per=st.integers(1, 3), anchor_bits=st.integers(1, 7),
           single=st.booleans(), zstd=st.booleans(), meta=st.sampled_from(["fp16", "fp32"]),
           seed=st.integers(0, 2**16))
    def check(heads, tokens, dim, layers, chunk_log, pages_per, anchor_bits, single, zstd, meta, seed):
        scheme = Scheme(chunk=1 << chunk_log, page=(1 << chunk_log) * pages_per, anchor_bits=anchor_bits,
                        residual_bits=8 - anchor_bits, meta_dtype=meta)
        enc = encode_kv(make_kv(layers, heads, tokens, dim, seed=seed), scheme)
        built = build_files(enc, single_file=single, zstd=zstd, residual_location="r")
        with open_cache(built.anchor, residual=built.residual) as cache:
            got = cache.load_encoded()
        for (gk, gv), (wk, wv) in zip(got.layers, enc.layers):
            for g, w in ((gk, wk), (gv, wv)):
                for name in ("anchor", "residual", "offset", "scale"):
                    assert torch.equal(getattr(g, name), getattr(w, name)), name

    check()


def test_every_scheme_the_writer_accepts_reads_back_equal():
    """Each scheme parameter as the header stores it round-trips exactly (alpha as f64, chunk and page as u32),
    and a header whose scheme the writer would refuse is refused by the reader."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lynxkv.errors import SchemeError
    from lynxkv.format import PageReader
    from lynxkv.quant.scheme import MAX_ALPHA, MAX_CHUNK, MAX_PAGE, MIN_ALPHA

    @st.composite
    def schemes(draw):
        chunk = 1 << draw(st.integers(0, MAX_CHUNK.bit_length() - 1))
        page = chunk * draw(st.integers(1, MAX_PAGE // chunk))
        anchor_bits = draw(st.integers(1, 7))
        alpha_law = draw(st.booleans())
        alpha = draw(st.floats(min_value=MIN_ALPHA, max_value=MAX_ALPHA)) if alpha_law else 0.0
        return Scheme(compander="alpha" if alpha_law else "linear", alpha=alpha,
                      centring=draw(st.sampled_from(["midrange", "mean"])), chunk=chunk, page=page,
                      anchor_bits=anchor_bits, residual_bits=8 - anchor_bits,
                      meta_dtype=draw(st.sampled_from(["fp16", "fp32"])), grid=draw(st.sampled_from(["nested", "uniform"])))

    kv = make_kv(1, 1, 3, 2)

    @settings(max_examples=40, deadline=None)
    @given(schemes())
    def roundtrip(scheme):
        built = build_files(encode_kv(kv, scheme), single_file=True)
        assert PageReader(BytesSource(built.anchor)).header.scheme == scheme

    roundtrip()
    with pytest.raises(SchemeError):
        Scheme(chunk=3)  # what the writer refuses ...
    built = bytearray(build_files(encode_kv(kv, Scheme(chunk=4, page=8)), single_file=True).anchor)
    struct.pack_into("<I", built, c.ANCHOR_FIELD_OFFSETS["chunk"], 3)
    length = struct.unpack_from("<I", built, 16)[0]
    struct.pack_into("<I", built, length - 4, zlib.crc32(bytes(built[:length - 4])))
    with pytest.raises(FormatError, match="scheme"):  # ... the reader refuses too
        PageReader(BytesSource(bytes(built)))
