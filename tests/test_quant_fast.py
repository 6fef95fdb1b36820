"""The fast CPU path and the quantizer entry against the torch reference: codes, packed bytes, metadata and
decoded values bit for bit (``torch.equal``), on awkward shapes, strided views and poisoned outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lynxkv.quant as entry
from lynxkv.errors import InputError
from lynxkv.quant import c_kernels, fast, reference, tables
from lynxkv.quant.pack import pack_bits as ref_pack_bits
from lynxkv.quant.pack import unpack_bits as ref_unpack_bits
from lynxkv.quant.scheme import get_scheme

pytestmark = pytest.mark.skipif(not fast.available(), reason="the compiled kernels were not built: the entry uses the "
                                                          "reference")

SCHEMES = {
    "default": get_scheme("default"),  # alpha = 0.5, keys Hadamard-rotated
    "linear": get_scheme("linear"),
    "mean": get_scheme("linear", centring="mean"),
    "fp32meta": get_scheme("default", meta_dtype="fp32"),
    "5+3": get_scheme("linear", anchor_bits=5),
    "3+5-mean": get_scheme("default", anchor_bits=3, centring="mean"),
    "C16": get_scheme("linear", chunk=16, page=64),
    "C1": get_scheme("default", chunk=1, page=1),
    "alpha100-5+3": get_scheme("default", alpha=100.0, anchor_bits=5),
    "alpha-tiny": get_scheme("default", alpha=1e-3),  # every element takes the exact pass
    "alpha-max": get_scheme("default", alpha=65504.0),
    "paper": get_scheme("paper"),  # uniform grid, mean centring
    "range": get_scheme("default", extremes="range"),  # 1.5: the end sub-bins decode at the chunk's extremes
    "range-linear-5+3": get_scheme("linear", anchor_bits=5, extremes="range"),
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


def assert_equal_values(ref, got, where=""):
    if ref.dtype != got.dtype or not torch.equal(ref, got):
        diff = (ref.float() != got.float()).nonzero()[:5].tolist()
        pytest.fail(f"{where}: decoded values differ ({ref.dtype}/{got.dtype}); first mismatches at {diff}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_quantize_is_bit_identical(scheme, shape, dtype):
    x = kv_like(shape, dtype)
    assert_same(reference.quantize_tokens(x, scheme), fast.quantize(x, scheme), f"{scheme.describe()} {shape} {dtype}")
    ref = reference.quantize(x, scheme)  # the keys: rotated first where the scheme says so
    assert_same(ref, entry.quantize(x, scheme), "entry")
    ap, rp, off, sc = entry.quantize_packed(x, scheme)
    assert torch.equal(ap, ref_pack_bits(ref.anchor, scheme.anchor_bits))
    assert torch.equal(rp, ref_pack_bits(ref.residual, scheme.residual_bits))
    assert torch.equal(off, ref.offset) and torch.equal(sc, ref.scale)


@pytest.mark.parametrize("meta", ["fp16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [128, 96, 80, 6, 1], ids=["D128", "D96-b32", "D80-b16", "D6-b2", "D1"])
def test_rotated_keys_are_rotated_inside_the_encode_pass(monkeypatch, d, dtype, meta):
    """Keys of a rotating scheme: the compiled pass rotates each (head, chunk) block itself, with the rotation
    module's butterfly order and power-of-two scale, and gives the reference's codes and metadata (huge, tiny,
    subnormal and signed-zero rows; a strided slice; a short last chunk); the torch rotation is not called."""
    scheme = get_scheme("default", meta_dtype=meta)
    assert scheme.rotated("key")
    g = torch.Generator().manual_seed(d)
    top = 2 if meta == "fp16" else 6  # the rotated sums must fit the metadata dtype
    big = torch.randn(2, 75, d, generator=g) * 10 ** torch.randint(-5, top, (1, 1, d), generator=g).float()
    big[0, 3] = 2.0**-140
    big[1, 5] = torch.tensor([-0.0 if i % 2 else 0.0 for i in range(d)])
    big[1, 6:9] = 1.0 + torch.arange(d) * 2.0**-23
    x = big.to(dtype)[:, 2:73]
    ref = reference.quantize(x.contiguous(), scheme)
    from lynxkv.quant import rotation

    def not_called(_):
        raise AssertionError("the keys went through a separate rotation pass")

    monkeypatch.setattr(rotation, "rotate", not_called)
    got = entry.quantize(x, scheme)
    assert got.rotated and ref.rotated
    assert_same(ref, got, f"rotated D={d} {dtype}")
    if fast.packable(scheme, d):
        ap, rp, off, sc = entry.quantize_packed(x, scheme)
        assert torch.equal(ap, ref_pack_bits(ref.anchor, 4)) and torch.equal(rp, ref_pack_bits(ref.residual, 4))
        assert torch.equal(off, ref.offset) and torch.equal(sc, ref.scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_values_per_channel_are_bit_identical(scheme, shape, dtype):
    """The compiled pass over groups of C channels of each token (read in place, codes in [H, T, D] order) gives
    the reference's encoding of the transpose: codes, metadata [H, T, ceil(D/C)] and packed bytes."""
    scheme = scheme.replace(value_axis="channel")
    x = kv_like(shape, dtype, seed=11)
    x[:, :, 1:3] = x[:, :, 1:2]  # a constant pair of channels
    ref = reference.quantize(x, scheme, "value")
    assert ref.axis == "channel"
    got = entry.quantize(x, scheme, "value")
    assert got.axis == "channel" and got.anchor.is_contiguous()
    assert_same(ref, got, f"{scheme.describe()} {shape} {dtype}")
    if fast.packable(scheme, shape[2]):
        ap, rp, off, sc = entry.quantize_packed(x, scheme, "value")
        assert torch.equal(ap, ref_pack_bits(ref.anchor, 4)) and torch.equal(rp, ref_pack_bits(ref.residual, 4))
        assert torch.equal(off, ref.offset) and torch.equal(sc, ref.scale)


def test_values_per_channel_read_a_strided_slice_in_place():
    scheme = SCHEMES["default"]
    big = kv_like((3, 90, 64), torch.bfloat16, seed=2)
    x = big[:, 7:80]  # [H, T, D] with a token stride of D and a head stride of 90·D
    assert_same(reference.quantize(x.contiguous(), scheme, "value"), entry.quantize(x, scheme, "value"), "slice")


@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", [SCHEMES[k] for k in ("default", "mean", "5+3", "fp32meta", "paper")],
                         ids=["default", "mean", "5+3", "fp32meta", "paper"])
def test_dequantize_is_bit_identical(scheme, shape, dtype, anchor_only):
    """The level table holds the reference's own û, so o + s·û is the reference's value in every dtype."""
    x = kv_like(shape, torch.float32, seed=1)
    enc = reference.quantize(x, scheme)
    ref = reference.dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype)
    out = torch.full(shape, float("nan"), dtype=dtype)  # poisoned: an element not written fails
    got = entry.dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype, out=out)
    assert got is out
    assert_equal_values(ref, got, "unpacked")
    ap, rp = ref_pack_bits(enc.anchor, scheme.anchor_bits), ref_pack_bits(enc.residual, scheme.residual_bits)
    out2 = torch.full(shape, float("nan"), dtype=dtype)
    got2 = entry.dequantize_packed(ap, None if anchor_only else rp, enc.offset, enc.scale, shape, scheme, out=out2)
    assert got2 is out2
    # the packed arrays carry no sink residual: every token from its anchor code
    ref2 = reference.dequantize(dataclasses.replace(enc, sinks=0), scheme, anchor_only=anchor_only, dtype=dtype)
    assert_equal_values(ref2, got2, "packed")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_strided_views_in_and_out(dtype):
    """A page of a larger cache is read and written in place: inputs and outputs may be token slices."""
    scheme = SCHEMES["default"]
    big = kv_like((3, 300, 16), dtype, seed=4)
    x = big[:, 64:192]  # not contiguous: head stride 300·16
    ref = reference.quantize(x.contiguous(), scheme)
    assert_same(ref, entry.quantize(x, scheme), "strided input")
    cache = torch.full((3, 300, 16), float("nan"), dtype=dtype)
    entry.dequantize(ref, scheme, out=cache[:, 64:192])
    assert_equal_values(reference.dequantize(ref, scheme, dtype=dtype), cache[:, 64:192], "strided output")
    assert bool(cache[:, :64].isnan().all() and cache[:, 192:].isnan().all()), "wrote outside the slice"


def test_code_table_near_every_threshold():
    """The kernel's codes equal the reference's for every fp32 u within 2,000 values of each code step, for
    schemes across the accepted α range, through the AVX2 encode (every code from the table) and the portable
    loops (a compander first pass that hands the elements near a step to the table); the whole of [-1, 1] is
    checked by benchmarks/check_code_identity.py."""
    for name in ("default", "linear", "paper", "alpha100-5+3", "alpha-tiny", "alpha-max", "3+5-mean"):
        scheme = SCHEMES[name]
        steps = tables.code_steps(scheme)
        keys = (steps[:, None] + torch.arange(-2000, 2000)[None, :]).reshape(-1).clamp(tables.KEY_MIN, tables.KEY_MAX)
        u = tables.u_of_key(keys)
        ref = reference.join_code(*reference.codes_of_u(u, scheme), scheme)
        for scalar in (0, 1):
            c_kernels.NATIVE.lynx_scalar_only(scalar)
            try:
                got = reference.join_code(*fast.codes_of_u(u, scheme), scheme)
            finally:
                c_kernels.NATIVE.lynx_scalar_only(0)
            miss = ref != got
            assert not bool(miss.any()), (f"{name} ({'portable' if scalar else 'vector'}): u={u[miss][:4].tolist()}: "
                                          f"{ref[miss][:4].tolist()} vs {got[miss][:4].tolist()}")


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
    alpha=st.sampled_from([1.0, 7.5, 255.0]),
    seed=st.integers(0, 2**16),
)
def test_quantize_property(h, t, d, chunk, centring, meta, dtype, spread, alpha, seed):
    scheme = get_scheme("default", chunk=chunk, page=chunk * 4, centring=centring, meta_dtype=meta, alpha=alpha)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((h, t, d), generator=g) * spread + torch.randn(d, generator=g) * spread).to(dtype)
    ref = reference.quantize_tokens(x, scheme)
    assert_same(ref, fast.quantize(x, scheme), "hypothesis")
    assert_equal_values(reference.dequantize(ref, scheme), fast.dequantize(ref, scheme), "hypothesis decode")
    assert_same(reference.quantize(x, scheme, "value"), entry.quantize(x, scheme, "value"), "hypothesis values")


def test_constant_and_signed_zero_chunks():
    scheme = get_scheme("default", centring="mean")
    x = torch.zeros((2, 45, 4))
    x[0] = -0.0
    x[1, :, 1] = 3.25
    assert_same(reference.quantize_tokens(x, scheme), fast.quantize(x, scheme), "constant")
    for centring in ("midrange", "mean"):  # groups along channels: all-zero groups keep their first zero's sign
        values = get_scheme("default", chunk=2, page=2, centring=centring)
        z = torch.zeros((1, 3, 6))
        z[0, 0, 0::2] = -0.0  # groups (-0, +0): the offset of a running max/min is -0
        z[0, 1, 1::2] = -0.0  # groups (+0, -0): +0
        z[0, 2, 4:] = torch.tensor([-0.0, 5.0])
        assert_same(reference.quantize(z, values, "value"), entry.quantize(z, values, "value"), centring)


def test_tiny_fp32_scales_take_the_exact_pass():
    """fp32 metadata can hold a scale whose reciprocal overflows: those chunks are coded exactly."""
    scheme = get_scheme("default", meta_dtype="fp32")
    x = torch.randn(1, 64, 8) * 1e-40
    assert_same(reference.quantize_tokens(x, scheme), fast.quantize(x, scheme), "subnormal")


def test_workers_do_not_change_the_result(monkeypatch):
    scheme = SCHEMES["default"]
    x = kv_like((3, 700, 8), torch.bfloat16, seed=3)
    ref = reference.quantize_tokens(x, scheme)
    for workers in ("1", "2", "3", "8"):
        monkeypatch.setenv("LYNXKV_CPU_THREADS", workers)
        assert_same(ref, fast.quantize(x, scheme), f"workers={workers}")
        ap, _, _, _ = fast.quantize_packed(x, scheme)
        assert torch.equal(ap, ref_pack_bits(ref.anchor, 4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("scheme", [SCHEMES["default"], SCHEMES["mean"]], ids=["midrange", "mean"])
def test_non_finite_input_is_an_input_error(bad, scheme):
    x = torch.randn(2, 40, 4)
    x[1, 37, 2] = bad
    for kind in ("key", "value"):
        for t in (x, x.bfloat16()):
            with pytest.raises(InputError, match="inf or NaN"):
                entry.quantize(t, scheme, kind)


def test_overflowing_metadata_is_an_input_error():
    x = torch.tensor([[[-1.0e5], [1.0e5]]])  # range 2e5 does not fit fp16
    with pytest.raises(InputError, match="overflows"):
        entry.quantize(x, SCHEMES["default"])


@pytest.mark.parametrize("count", [0, 2, 64, 1000, 1 << 19])
def test_pack_unpack_match_reference(count):
    values = torch.randint(0, 16, (count,), dtype=torch.uint8)
    packed = entry.pack_bits(values, 4)
    assert torch.equal(packed, ref_pack_bits(values, 4))
    assert torch.equal(entry.unpack_bits(packed, 4, count), ref_unpack_bits(packed, 4, count))


def test_dequantize_packed_rejects_wrong_payload_size():
    scheme = SCHEMES["default"]
    enc = reference.quantize(torch.randn(1, 32, 4), scheme)
    with pytest.raises(InputError, match="residual payload"):
        entry.dequantize_packed(ref_pack_bits(enc.anchor, 4), torch.zeros(3, dtype=torch.uint8), enc.offset,
                                enc.scale, (1, 32, 4), scheme)


def test_dequantize_rejects_a_wrong_out_shape():
    scheme = SCHEMES["default"]
    enc = reference.quantize(torch.randn(1, 32, 4), scheme)
    with pytest.raises(InputError, match="out"):
        entry.dequantize(enc, scheme, out=torch.empty(1, 31, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [SHAPES[k] for k in ("T1", "prime-T", "odd-D", "T-257")],
                         ids=["T1", "prime-T", "odd-D", "T-257"])
@pytest.mark.parametrize("scheme", [get_scheme("default"), get_scheme("default", centring="mean", chunk=4, page=8),
                                    get_scheme("linear").replace(value_axis="channel", sink_tokens=40)],
                         ids=["default", "mean-C4-P8", "linear-S40"])
def test_values_per_channel_and_sink_tokens_are_bit_identical(scheme, shape, dtype):
    """Values grouped per channel (the compiled pass over channel groups) and the sink tokens decoded
    from the full code give the reference's codes and values, written in place into a strided slice."""
    x = kv_like(shape, dtype, seed=3)
    for kind in ("key", "value"):
        ref = reference.quantize(x, scheme, kind)
        got = entry.quantize(x, scheme, kind)
        assert (got.axis, got.sinks) == (ref.axis, ref.sinks) == (scheme.axis(kind), min(scheme.sink_tokens, shape[1]))
        assert_same(ref, got, f"{kind} {scheme.describe()} {shape}")
        for anchor_only in (False, True):
            want = reference.dequantize(ref, scheme, anchor_only=anchor_only, dtype=dtype)
            big = torch.full((shape[0], shape[1] + 3, shape[2]), float("nan"), dtype=dtype)
            out = entry.dequantize(got, scheme, anchor_only=anchor_only, out=big[:, 1:1 + shape[1]])
            assert_equal_values(want, out, f"{kind} anchor_only={anchor_only}")
            assert bool(big[:, 0].isnan().all()) and bool(big[:, -2:].isnan().all()), "wrote outside out"
        if scheme.sink_tokens:  # the sinks really decode differently from the anchor alone
            plain = reference.dequantize(dataclasses.replace(ref, sinks=0), scheme, anchor_only=True)
            sunk = reference.dequantize(ref, scheme, anchor_only=True)
            n = ref.sinks
            assert torch.equal(sunk[:, n:], plain[:, n:])
            assert torch.equal(sunk[:, :n], reference.dequantize(ref, scheme)[:, :n])


def _page_records(enc, scheme, page):
    """Anchor and residual bytes laid out as records (offsets | scales | packed codes), one per page, each at an
    odd byte offset (records may start anywhere), and the page rows for ``dequantize_pages``."""
    h, t, d = enc.anchor.shape
    anchor, residual, rows = bytearray(b"\x01"), bytearray(b"\x01\x02\x03"), []
    for t0 in range(0, t, page):
        p = enc.tokens(t0, min(t0 + page, t), scheme.chunk)
        at, r_at = len(anchor), len(residual)
        offsets, scales = (m.numpy().tobytes() for m in (p.offset, p.scale))  # C order, little-endian here
        codes = ref_pack_bits(p.anchor, scheme.anchor_bits).numpy().tobytes()
        anchor += offsets + scales + codes + b"\x07"
        residual += ref_pack_bits(p.residual, scheme.residual_bits).numpy().tobytes() + b"\x05"
        rows.append((at, at + len(offsets), at + 2 * len(offsets), r_at, t0, p.anchor.shape[1]))
    return bytes(anchor), bytes(residual), rows


@pytest.mark.parametrize("layout", ["contiguous", "token-slice", "transposed"])
@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("scheme,shape", [(SCHEMES["default"], (3, 257, 64)), (SCHEMES["fp32meta"], (2, 33, 8)),
                                          (SCHEMES["5+3"], (2, 50, 5)), (SCHEMES["C1"], (1, 3, 4))],
                         ids=["default-T257", "fp32meta", "5+3-odd-D", "C1"])
def test_dequantize_pages_is_bit_identical(scheme, shape, dtype, anchor_only, layout):
    """Page records in byte buffers decode straight into any view of the output, as the reference decodes the
    whole tensor; nothing outside the view is touched."""
    x = kv_like(shape, torch.float32, seed=3)
    enc = dataclasses.replace(reference.quantize(x, scheme), sinks=0)  # page records of groups along tokens only
    ref = reference.dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype)
    page = max(scheme.chunk, 2 * scheme.chunk if shape[1] > 2 * scheme.chunk else scheme.chunk)
    anchor, residual, rows = _page_records(enc, scheme, page)
    h, t, d = shape
    if layout == "contiguous":
        big = torch.full(shape, float("nan"), dtype=dtype)
        out = big
    elif layout == "token-slice":  # the tokens [5, 5 + T) of a longer cache
        big = torch.full((h, t + 9, d), float("nan"), dtype=dtype)
        out = big[:, 5:5 + t]
    else:  # a [H, T, D] view of a [H, D, T] tensor: the last axis is strided
        big = torch.full((h, d, t), float("nan"), dtype=dtype)
        out = big.transpose(1, 2)
    flags = entry.dequantize_pages(anchor, None if anchor_only else residual, rows, scheme, out=out)
    assert flags == 0
    assert_equal_values(ref, out, layout)
    if layout == "token-slice":
        assert torch.isnan(big[:, :5].float()).all() and torch.isnan(big[:, 5 + t:].float()).all()


def test_dequantize_pages_flags_and_bounds():
    """Bad metadata is reported, not hidden; a page outside its buffers is refused before anything is read."""
    scheme = SCHEMES["default"]
    enc = reference.quantize(kv_like((2, 64, 8), torch.float32), scheme)
    anchor, residual, rows = _page_records(enc, scheme, 32)
    out = torch.empty((2, 64, 8))
    assert entry.dequantize_pages(anchor, residual, rows, scheme, out=out) == 0
    for value, flag in ((float("inf"), 1), (float("nan"), 1)):
        bad = bytearray(anchor)
        bad[rows[1][0]:rows[1][0] + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
        assert entry.dequantize_pages(bytes(bad), residual, rows, scheme, out=out) == flag
    bad = bytearray(anchor)
    bad[rows[0][1]:rows[0][1] + 2] = torch.tensor([-1.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert entry.dequantize_pages(bytes(bad), residual, rows, scheme, out=out) == 4
    bad[rows[0][1]:rows[0][1] + 2] = torch.tensor([-0.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert entry.dequantize_pages(bytes(bad), residual, rows, scheme, out=out) == 0  # -0.0 is a zero scale
    with pytest.raises(InputError, match="outside"):
        entry.dequantize_pages(anchor[:-10], residual, rows, scheme, out=out)
    with pytest.raises(InputError, match="outside"):
        entry.dequantize_pages(anchor, residual, [(*rows[1][:4], 40, 32)], scheme, out=out)


@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(3, 257, 64), (2, 33, 40), (1, 3, 4)], ids=["T257", "D40", "tiny"])
def test_dequantize_pages_values_per_channel(shape, dtype, anchor_only):
    """Values grouped per token over channels: metadata [H, n, ceil(D/C)] per page, decoded in the
    same compiled pass as the reference decodes the whole tensor (sink tokens are the caller's, so none here)."""
    scheme = get_scheme("default", sink_tokens=0)
    assert scheme.axis("value") == "channel"
    enc = reference.quantize(kv_like(shape, torch.float32, seed=5), scheme, "value")
    ref = reference.dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype)
    anchor, residual, rows = _page_records(enc, scheme, 64)
    out = torch.full(shape, float("nan"), dtype=dtype)
    assert entry.dequantize_pages(anchor, None if anchor_only else residual, rows, scheme, out=out, kind="value") == 0
    assert_equal_values(ref, out, "values per channel")


@pytest.mark.parametrize("split", [(4, 4), (5, 3)])
def test_anchor_only_values_per_channel_need_no_residual(split):
    """The entry decodes a channel-axis tensor from its anchor alone when no residual codes are held at all (a
    progressive reader before the residual arrives), equal to the reference's anchor-only decode."""
    scheme = dataclasses.replace(get_scheme("default"), anchor_bits=split[0], residual_bits=split[1])
    assert scheme.value_axis == "channel"
    enc = dataclasses.replace(entry.quantize(torch.randn(2, 70, 40), scheme, "value"), sinks=0)
    want = reference.dequantize(enc, scheme, anchor_only=True)
    got = entry.dequantize(dataclasses.replace(enc, residual=None), scheme, anchor_only=True)
    assert torch.equal(got, want)


FP16_SPECIAL = [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00,
                0x7C01, 0x3555]  # zeros, subnormals, the smallest normal, ±1, ±max, ±inf, NaNs, 1/3


@pytest.mark.skipif(fast.native() != "avx2", reason="the vector rows do not run on this CPU")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "bytes"])
@pytest.mark.parametrize("wide", [False, True], ids=["fp16meta", "fp32meta"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d,per_row,chunk", [(128, False, 4), (96, False, 4), (80, False, 4), (6, False, 4),
                                             (40, False, 4), (128, True, 4), (48, True, 4), (5, True, 4),
                                             (128, True, 32), (64, True, 16)],
                         ids=["D128", "D96-b32", "D80-b16", "D6-b2", "D40", "D128-rows", "D48-rows", "D5-rows",
                              "D128-rows-C32", "D64-rows-C16"])
def test_vector_rows_equal_the_scalar_rows(d, per_row, chunk, out_dtype, wide, packed):
    """The decode's AVX2 rows and its scalar rows give the same bits and flags on random codes and hostile
    metadata (subnormal, infinite and NaN offsets and scales, negative and signed-zero scales), in every layout the
    vector rows take or fall back from: rotated blocks of 128, 32, 16 and 2 channels, head_dim not a multiple of
    16, groups along rows (of 4 channels, and of 16 and 32: one fp16 offset and scale per group widened in a
    vector pass), fp32 metadata, unpacked codes and a strided output. The flags are those the metadata
    calls for. NaN results only need to be NaN in both (which NaN an IEEE sum keeps depends on the operand
    order)."""
    if packed and d % 2:
        pytest.skip("packed codes need an even head_dim")
    scheme = get_scheme("default", meta_dtype="fp32" if wide else "fp16", chunk=chunk, page=max(8, chunk))
    g = torch.Generator().manual_seed(d * 7 + per_row + chunk)
    h, t, mb = 2, 13, 4 if wide else 2
    groups = -(-d // scheme.chunk)
    n_meta = h * (t * groups if per_row else -(-t // scheme.chunk) * d)
    code_bytes = h * t * d // 2 if packed else h * t * d
    if wide:
        meta = torch.randn(2 * n_meta, generator=g) * 3
        special = torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("nan"), -2.0])
    else:
        meta = (torch.randn(2 * n_meta, generator=g) * 3).half()
        special = torch.tensor(FP16_SPECIAL, dtype=torch.int32).to(torch.int16).view(torch.float16)
    pick = torch.randint(0, 2 * n_meta, (2 * n_meta // 5,), generator=g)
    hostile = meta.clone()
    hostile[pick] = special[torch.randint(0, special.numel(), pick.shape, generator=g)].to(meta.dtype)
    codes = torch.randint(0, 256 if packed else 16, (code_bytes,), dtype=torch.uint8, generator=g).numpy()
    resid = torch.randint(0, 256 if packed else 16, (code_bytes,), dtype=torch.uint8, generator=g).numpy()
    pages = [(0, n_meta * mb, 0, 0, 0, t, d)]

    def check(meta):
        o, s = meta[:n_meta].float(), meta[n_meta:].float()
        want = (1 if bool((~o.isfinite()).any()) else 0) | (2 if bool((~s.isfinite()).any()) else 0) | (
            4 if bool(((s < 0) & ~s.isnan()).any()) else 0)
        meta_bytes = meta.view(torch.uint8).numpy()
        for anchor_only in (False, True):
            results = []
            for scalar in (0, 1):
                c_kernels.NATIVE.lynx_scalar_only(scalar)
                try:
                    big = torch.full((h, d, t + 3), float("nan"), dtype=out_dtype)
                    outs = [torch.full((h, t, d), float("nan"), dtype=out_dtype), big[:, :, 2:2 + t].transpose(1, 2)]
                    flags = [fast._decode_pages(meta_bytes, meta_bytes, codes, None if anchor_only else resid, pages,
                                                packed, scheme, out, 2, per_row=per_row, rotated=not per_row and d > 1)
                             for out in outs]
                finally:
                    c_kernels.NATIVE.lynx_scalar_only(0)
                results.append((flags, outs))
            (f_vec, out_vec), (f_sc, out_sc) = results
            assert f_vec == f_sc == [want, want], f"flags {f_vec} (vector), {f_sc} (scalar), want {want}"
            bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
            for a, b in zip(out_vec, out_sc):
                same = (a.float().isnan() & b.float().isnan()) | (a.view(bits) == b.view(bits))
                assert bool(same.all()), f"anchor_only={anchor_only}: {int((~same).sum())} elements differ"
        return want

    assert check(hostile) != 0
    plain = meta.abs() + 0.5  # finite, positive: no flag, until one special value goes in
    assert check(plain) == 0
    for value in special:  # each alone, as an offset and as a scale: each flag on its own
        for at in (n_meta // 2, n_meta + n_meta // 2):
            one = plain.clone()
            one[at] = value.to(meta.dtype)
            check(one)


def _hostile_keys(shape, dtype, g, case):
    """KV-like rows with outlier channels, or one of the inputs the metadata and codes must survive bit for bit:
    groups of (signed) zeros, constant groups, subnormal-sized and fp16-overflowing magnitudes, inf and NaN."""
    h, t, d = shape
    x = torch.randn(shape, generator=g) * (torch.rand(d, generator=g) * 3 + 0.05)
    x[..., : max(1, d // 16)] *= 20.0
    if case == "zeros":
        x[:, : t // 2] = 0.0
        x[:, 0, ::2] = -0.0  # groups of mixed zeros whose first is -0.0 keep its sign
        x[:, 3] = 2.5  # a constant row
    elif case == "magnitudes":
        x = x * 2.0 ** torch.randint(-60, 30, (h, 1, d), generator=g).float()
    elif case == "overflow":
        x[0, 2, 5] = 1e6  # past fp16's range: the centre or the scale overflows the fp16 metadata
    elif case == "nonfinite":
        x[1 % h, t - 1, d - 1] = float("nan") if d % 2 else float("inf")
    return x.to(dtype)


@pytest.mark.skipif(fast.native() != "avx2", reason="the vector encode does not run on this CPU")
@pytest.mark.parametrize("case", ["kv", "zeros", "magnitudes", "overflow", "nonfinite"])
@pytest.mark.parametrize("meta", ["fp16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d,axis,chunk,rotated", [
    (128, "token", 32, True), (128, "token", 32, False), (96, "token", 4, True), (80, "token", 8, True),
    (64, "token", 1, False), (40, "token", 32, False), (128, "channel", 32, False), (48, "channel", 16, False),
    (64, "channel", 8, False), (96, "channel", 64, False), (128, "channel", 4, False)],
    ids=["D128-rot", "D128", "D96-b32-C4", "D80-b16", "D64-C1", "D40", "D128-rows", "D48-rows", "D64-rows-C8",
         "D96-rows-C64", "D128-rows-C4"])
def test_vector_encode_equals_the_scalar_encode(d, axis, chunk, rotated, dtype, meta, case):
    """The encode's AVX2 units (every code from the bucket table) and its portable loops (an fp32 compander first,
    the table near each step) give the same codes, packed and one per byte, the same metadata and the same
    errors, in every layout the vector units take or leave to the loops: rotated blocks of 128, 32 and 16
    channels, chunks of 1 to 64 tokens, groups along rows, head_dim not a multiple of 16; midrange and mean
    centring."""
    g = torch.Generator().manual_seed(d * 31 + chunk)
    x = _hostile_keys((2, 45, d), dtype, g, case)
    for centring in ("midrange", "mean"):
        scheme = get_scheme("default", meta_dtype=meta, chunk=chunk, page=max(chunk, 8), centring=centring)
        for packed in (True, False):
            results = []
            for scalar in (0, 1):
                c_kernels.NATIVE.lynx_scalar_only(scalar)
                try:
                    results.append(fast._codes(x, scheme, packed, axis=axis, rotated=rotated))
                except InputError as exc:
                    results.append(str(exc))
                finally:
                    c_kernels.NATIVE.lynx_scalar_only(0)
            vec, sca = results
            where = f"{centring}, packed={packed}"
            if isinstance(sca, str) or isinstance(vec, str):
                assert vec == sca, f"{where}: {vec!r} vs {sca!r}"
                continue
            for name, a, b in zip(("anchor", "residual", "offset", "scale"), vec, sca):
                bits = a.view(torch.int16 if a.dtype == torch.float16 else torch.int32) if a.is_floating_point() else a
                other = b.view(bits.dtype) if b.is_floating_point() else b
                assert torch.equal(bits, other), f"{where}: the {name}s differ"
    assert case != "nonfinite" or isinstance(vec, str), "a non-finite input must be refused"
