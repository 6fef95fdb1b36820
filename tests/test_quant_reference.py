"""The reference quantizer: lossless split, per-element error bound, determinism, awkward shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynxkv.errors import InputError, SchemeError
from lynxkv.quant import (EncodedTensor, dequantize, error_bound, join_code, pack_bits, quantize, split_code,
                          unpack_bits)
from lynxkv.quant.scheme import DEFAULT, PAPER, PRESETS, Scheme, get_scheme

SCHEMES = {
    "default": DEFAULT,
    "paper": PAPER,
    "paper-a1": PRESETS["paper-a1"],
    "3+5": DEFAULT.replace(anchor_bits=3, residual_bits=5),
    "6+2": DEFAULT.replace(anchor_bits=6, residual_bits=2),
    "C16-fp32": DEFAULT.replace(chunk=16, meta_dtype="fp32"),
    "range": DEFAULT.replace(extremes="range"),
    "range-linear-7+1": Scheme(extremes="range", anchor_bits=7, residual_bits=1),
}


@st.composite
def kv_tensors(draw):
    h = draw(st.integers(1, 3))
    t = draw(st.integers(1, 80))
    d = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    bias = draw(st.sampled_from([0.0, 5.0, -200.0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((h, t, d), generator=g) * scale + bias
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return x.to(dtype)


@pytest.mark.parametrize("name", list(SCHEMES))
@settings(max_examples=40, deadline=None)
@given(x=kv_tensors())
def test_split_lossless_and_error_within_bound(name, x):
    scheme = SCHEMES[name]
    enc = quantize(x, scheme)
    assert int(enc.anchor.max()) <= scheme.anchor_steps
    assert int(enc.residual.max()) < scheme.residual_levels
    code = join_code(enc.anchor, enc.residual, scheme)
    a, r = split_code(code, scheme)
    assert torch.equal(a, enc.anchor) and torch.equal(r, enc.residual)
    x32 = x.float()
    for anchor_only in (False, True):
        err = (dequantize(enc, scheme, anchor_only=anchor_only) - x32).abs()
        bound = error_bound(enc, scheme, anchor_only=anchor_only)
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), (
            f"anchor_only={anchor_only}: element {worst} err {err.flatten()[worst]} > bound {bound.flatten()[worst]}"
        )


@settings(max_examples=25, deadline=None)
@given(x=kv_tensors())
def test_encode_decode_deterministic(x):
    e1, e2 = quantize(x, DEFAULT), quantize(x.clone(), DEFAULT)
    for f in ("anchor", "residual", "offset", "scale"):
        assert torch.equal(getattr(e1, f), getattr(e2, f))
    assert torch.equal(dequantize(e1, DEFAULT), dequantize(e2, DEFAULT))


def test_anchor_levels_include_chunk_extremes():
    # With mid-range centring the first and last anchor levels reproduce the chunk's min and max (up to the
    # fp16 rounding of offset and scale), which is what makes the anchor a good 4-bit quantizer.
    x = torch.linspace(-3.0, 5.0, 32).reshape(1, 32, 1)
    scheme = DEFAULT.replace(sink_tokens=0)  # a sink token would decode from the full code
    enc = quantize(x, scheme)
    y = dequantize(enc, scheme, anchor_only=True)
    assert int(enc.anchor.min()) == 0 and int(enc.anchor.max()) == DEFAULT.anchor_steps
    assert abs(float(y.min()) + 3.0) < 5e-3 and abs(float(y.max()) - 5.0) < 5e-3


def test_constant_chunk_is_exact():
    x = torch.full((2, 40, 3), 0.1)
    enc = quantize(x, DEFAULT)
    for anchor_only in (False, True):
        y = dequantize(enc, DEFAULT, anchor_only=anchor_only)
        assert float((y - x).abs().max()) <= float(error_bound(enc, DEFAULT).max())
    exact = torch.full((1, 5, 2), 0.5)  # representable in fp16: offset = x, scale = 0
    enc = quantize(exact, DEFAULT)
    assert float(enc.scale.float().abs().max()) == 0.0
    assert torch.equal(dequantize(enc, DEFAULT, anchor_only=True), exact)


@pytest.mark.parametrize("t", [1, 31, 32, 33, 255, 257])
def test_chunks_do_not_depend_on_tail(t):
    # A chunk's codes depend only on its own tokens: encoding a prefix gives the prefix of the codes.
    x = torch.randn(2, 300, 4)
    full, part = quantize(x, DEFAULT), quantize(x[:, :t], DEFAULT)
    whole_chunks = t // DEFAULT.chunk * DEFAULT.chunk
    assert torch.equal(full.anchor[:, :whole_chunks], part.anchor[:, :whole_chunks])
    assert part.offset.shape[1] == -(-t // DEFAULT.chunk)


def test_rejects_non_finite_and_bad_shapes():
    with pytest.raises(InputError, match="inf or NaN"):
        quantize(torch.tensor([[[float("nan")]]]), DEFAULT)
    with pytest.raises(InputError, match="kv_heads, tokens, head_dim"):
        quantize(torch.zeros(4, 4), DEFAULT)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"chunk": 24}, "chunk"),
        ({"page": 100}, "page"),
        ({"anchor_bits": 5}, "anchor_bits"),
        ({"compander": "alpha", "alpha": 0.0}, "alpha"),
        ({"meta_dtype": "bf16"}, "meta_dtype"),
    ],
)
def test_scheme_validation_names_the_field(changes, field):
    with pytest.raises(SchemeError, match=field):
        Scheme(**changes)


def test_get_scheme_overrides():
    s = get_scheme("default", anchor_bits=5, chunk=64)
    assert (s.anchor_bits, s.residual_bits, s.chunk) == (5, 3, 64)
    assert get_scheme("default", alpha=10.0).compander == "alpha"
    with pytest.raises(SchemeError, match="unknown preset"):
        get_scheme("nope")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001])
def test_pack_roundtrip(bits, n):
    v = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = pack_bits(v, bits)
    assert packed.numel() == (n * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, n), v)


def test_pack_nibble_order():
    # LSB-first: the first value is the low nibble of the first byte.
    assert pack_bits(torch.tensor([0x1, 0xA, 0x3], dtype=torch.uint8), 4).tolist() == [0xA1, 0x03]


@pytest.mark.parametrize("anchor_bits", [1, 4, 6, 7])
def test_extremes_range_decodes_the_end_sub_bins_at_the_chunk_extremes(anchor_bits):
    """Format 1.6: the codes (0, R/2), (A, R/2 - 1) and (A, R/2) decode at o - s, o + s and o + s from the full
    code; every other code, and the anchor alone, as with extremes = midpoint."""
    mid = Scheme(compander="alpha", alpha=0.5, chunk=4, page=4, anchor_bits=anchor_bits,
                 residual_bits=8 - anchor_bits)
    rng = mid.replace(extremes="range")
    A, R = mid.anchor_steps, mid.residual_levels
    codes = torch.arange(256, dtype=torch.int32)
    a, r = (codes // R).to(torch.uint8), (codes % R).to(torch.uint8)
    keep = (a.long() <= A) & (r.long() < R)
    a, r = a[keep], r[keep]
    n = a.numel()
    enc = EncodedTensor(a.view(1, n, 1), r.view(1, n, 1), torch.full((1, -(-n // 4), 1), 2.0, dtype=torch.float16),
                        torch.full((1, -(-n // 4), 1), 0.5, dtype=torch.float16))
    got, was = (dequantize(enc, s).view(-1) for s in (rng, mid))
    low = (a == 0) & (r == R // 2)
    high = (a == A) & ((r == R // 2 - 1) | (r == R // 2))
    assert got[low].tolist() == [1.5] and got[high].tolist() == [2.5, 2.5]
    assert torch.equal(got[~(low | high)], was[~(low | high)])
    assert float(was[low]) > 1.5 and float(was[high].max()) > 2.5 > float(was[high].min())  # half a sub-bin off
    assert torch.equal(dequantize(enc, rng, anchor_only=True), dequantize(enc, mid, anchor_only=True))


def test_extremes_range_removes_the_shrink_of_every_chunks_extremes():
    """With the scale rounded up to fp16, a chunk's max lands just below the grid's top and its min just above
    the bottom; decoded at the end sub-bins' midpoints both move towards the centre, and the decoded values'
    energy shrinks. Decoded at the range ends the shrink is gone (KV-like data, 64 channels, 256 tokens)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, 64, generator=g) * (torch.rand(64, generator=g) * 2 + 0.1) + torch.randn(64, generator=g)
    for scheme in (DEFAULT, Scheme()):
        shrink = {}
        for extremes in ("midpoint", "range"):
            s = scheme.replace(extremes=extremes)
            y = dequantize(quantize(x, s), s)
            shrink[extremes] = float((y.double() ** 2).sum() / (x.double() ** 2).sum() - 1)
            assert bool(((y - x).abs() <= error_bound(quantize(x, s), s)).all())
        assert shrink["midpoint"] < -1e-3, shrink  # the bias 1.6 removes
        assert abs(shrink["range"]) < abs(shrink["midpoint"]) / 4, shrink
