"""The fast CPU path against the torch reference: integers and metadata bit for bit, values within tolerance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynxkv.errors import InputError
from lynxkv.quant import dequantize, pack_bits, quantize, unpack_bits
from lynxkv.quant import fast
from lynxkv.quant.scheme import get_scheme

SCHEMES = {
    "default": get_scheme("default"),  # alpha = 1
    "linear": get_scheme("linear"),
    "mean": get_scheme("linear", centring="mean"),
    "fp32meta": get_scheme("linear", meta_dtype="fp32"),
    "5+3": get_scheme("linear", anchor_bits=5),
    "3+5-mean": get_scheme("linear", anchor_bits=3, centring="mean"),
    "C16": get_scheme("linear", chunk=16, page=64),
    "C1": get_scheme("linear", chunk=1, page=1),
    "alpha100-5+3": get_scheme("default", alpha=100.0, anchor_bits=5),
    "paper": get_scheme("paper"),  # uniform grid: falls back to the reference, must still agree
}
SHAPES = {
    "T1": (3, 1, 64),
    "prime-T": (1, 37, 16),
    "T=C+1": (2, 33, 8),
    "odd-D": (2, 50, 5),
    "T-257": (3, 257, 64),
    "one-head-long": (1, 600, 4),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FIELDS = ("anchor", "residual", "offset", "scale")


def kv_like(shape, dtype, seed=0):
    """Per-channel offsets and scales, a couple of outlier channels, repeated values (KV statistics)."""
    g = torch.Generator().manual_seed(seed)
    h, t, d = shape
    x = torch.randn(shape, generator=g) * (torch.rand(d, generator=g) * 3 + 0.05) + torch.randn(d, generator=g) * 2
    x[..., : max(1, d // 16)] *= 20.0
    if t > 4:
        x[:, 1:3] = x[:, 1:2]  # a constant run
    return x.to(dtype)


def assert_same(ref, got, where=""):
    for name in FIELDS:
        a, b = getattr(ref, name), getattr(got, name)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.float() != b.float()).nonzero()[:5].tolist() if a.shape == b.shape else "shape"
            pytest.fail(f"{where}: {name} differs (dtypes {a.dtype}/{b.dtype}, shapes {tuple(a.shape)}/"
                        f"{tuple(b.shape)}); first mismatches at {diff}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_quantize_fast_is_bit_identical(scheme, shape, dtype):
    x = kv_like(shape, dtype)
    ref = quantize(x, scheme)
    assert_same(ref, fast.quantize_fast(x, scheme), f"{scheme.describe()} {shape} {dtype}")
    ap, rp, off, sc = fast.encode_packed_fast(x, scheme)
    assert torch.equal(ap, pack_bits(ref.anchor, scheme.anchor_bits))
    assert torch.equal(rp, pack_bits(ref.residual, scheme.residual_bits))
    assert torch.equal(off, ref.offset) and torch.equal(sc, ref.scale)


# Decoding is an affine map per (chunk, channel) evaluated in another order than the reference: a few fp32 ulps
# of |o| + s; in a narrower output dtype at most one ulp of that dtype on top.
DECODE_REL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", [SCHEMES["default"], SCHEMES["mean"], SCHEMES["5+3"]], ids=["default", "mean", "5+3"])
def test_decode_fast_within_tolerance(scheme, shape, dtype, anchor_only):
    x = kv_like(shape, torch.float32, seed=1)
    enc = quantize(x, scheme)
    ref = dequantize(enc, scheme, anchor_only=anchor_only)  # fp32
    bound = DECODE_REL[dtype] * (enc.offset.float().abs() + enc.scale.float()).repeat_interleave(scheme.chunk, 1)[:, : shape[1]]
    out = torch.full(shape, float("nan"), dtype=dtype)  # poisoned: an element not written fails
    got = fast.dequantize_fast(enc, scheme, anchor_only=anchor_only, dtype=dtype, out=out)
    assert got is out
    err = (got.float() - ref).abs()
    assert bool((err <= bound).all()), f"worst error {err.max().item():.3g} at {divmod(int(err.argmax()), shape[2])}"
    ap, rp = pack_bits(enc.anchor, scheme.anchor_bits), pack_bits(enc.residual, scheme.residual_bits)
    out2 = torch.full(shape, float("nan"), dtype=dtype)
    got2 = fast.decode_packed_fast(ap, None if anchor_only else rp, enc.offset, enc.scale, shape, scheme, dtype=dtype, out=out2)
    err2 = (got2.float() - ref).abs()
    assert bool((err2 <= bound).all()), f"packed: worst error {err2.max().item():.3g}"


@pytest.mark.parametrize("levels", [2, 8, 16, 32, 128])
def test_code_identity_near_every_boundary(levels):
    """The collapsed code formula equals the reference's two-step rounding for every fp32 within 2^12 ulps of
    each multiple of 1/R in [0, A] (where the rounding decisions happen); the full range is checked by
    benchmarks/check_code_identity.py."""
    a_steps = 256 // levels - 1
    centres = torch.arange(0, a_steps * levels + 1, dtype=torch.float32) / levels  # [n]
    bits = centres.view(torch.int32)[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)[None, :]
    v = bits.view(torch.float32).reshape(-1)
    v = v[(v >= 0) & (v <= a_steps)]
    a = torch.clamp(torch.floor(v + 0.5), 0.0, float(a_steps))
    r = torch.clamp(torch.floor((v - a + 0.5) * levels), 0.0, levels - 1.0)
    ref = a * levels + r
    got = fast.code_from_w(v * levels, levels, torch.empty_like(v))
    miss = ref != got
    assert not bool(miss.any()), f"v={v[miss][:4].tolist()}: reference {ref[miss][:4].tolist()}, fast {got[miss][:4].tolist()}"


@settings(max_examples=40, deadline=None)
@given(
    h=st.integers(1, 3),
    t=st.integers(1, 140),
    d=st.integers(1, 20),
    chunk=st.sampled_from([1, 2, 8, 32]),
    centring=st.sampled_from(["midrange", "mean"]),
    meta=st.sampled_from(["fp16", "fp32"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    spread=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_quantize_fast_property(h, t, d, chunk, centring, meta, dtype, spread, seed):
    scheme = get_scheme("default", chunk=chunk, page=chunk * 4, centring=centring, meta_dtype=meta)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((h, t, d), generator=g) * spread + torch.randn(d, generator=g) * spread).to(dtype)
    assert_same(quantize(x, scheme), fast.quantize_fast(x, scheme), "hypothesis")


def test_constant_and_signed_zero_chunks():
    scheme = get_scheme("default", centring="mean")
    x = torch.zeros((2, 45, 4))
    x[0] = -0.0
    x[1, :, 1] = 3.25
    assert_same(quantize(x, scheme), fast.quantize_fast(x, scheme), "constant")


def test_blocks_and_workers_do_not_change_the_result(monkeypatch):
    scheme = SCHEMES["default"]
    x = kv_like((3, 700, 8), torch.bfloat16, seed=3)
    ref = quantize(x, scheme)
    for block, workers in [(256, "1"), (256, "2"), (1 << 20, "2"), (7000, "3")]:
        monkeypatch.setattr(fast, "BLOCK_ELEMENTS", block)
        monkeypatch.setenv("LYNXKV_CPU_THREADS", workers)
        assert_same(ref, fast.quantize_fast(x, scheme), f"block={block} workers={workers}")
        ap, _, _, _ = fast.encode_packed_fast(x, scheme)
        assert torch.equal(ap, pack_bits(ref.anchor, 4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_input_is_an_input_error(bad):
    x = torch.randn(2, 40, 4)
    x[1, 37, 2] = bad
    with pytest.raises(InputError, match="inf or NaN"):
        fast.quantize_fast(x, SCHEMES["default"])


def test_overflowing_metadata_is_an_input_error():
    x = torch.tensor([[[-1.0e5], [1.0e5]]])  # range 2e5 does not fit fp16
    with pytest.raises(InputError, match="overflows"):
        fast.quantize_fast(x, SCHEMES["default"])


@pytest.mark.parametrize("count", [0, 2, 64, 1000])
def test_pack_unpack_match_reference(count):
    values = torch.randint(0, 16, (count,), dtype=torch.uint8)
    packed = fast.pack(values, 4)
    assert torch.equal(packed, pack_bits(values, 4))
    assert torch.equal(fast.unpack(packed, 4, count), unpack_bits(packed, 4, count))


def test_decode_packed_rejects_wrong_payload_size():
    scheme = SCHEMES["default"]
    enc = quantize(torch.randn(1, 32, 4), scheme)
    with pytest.raises(InputError, match="residual payload"):
        fast.decode_packed_fast(pack_bits(enc.anchor, 4), torch.zeros(3, dtype=torch.uint8), enc.offset, enc.scale, (1, 32, 4), scheme)


def test_best_quantize_on_cpu():
    assert fast.best_quantize(SCHEMES["default"], "cpu") is fast.quantize_fast
    assert fast.best_quantize(SCHEMES["paper"], "cpu") is quantize
