"""The Triton kernels against the torch reference: codes, packed bytes and metadata bit for bit, decoded
values within a per-dtype tolerance.

Without a GPU these run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is
imported); with one, the ``cuda`` variants run the compiled kernels (``pytest -m cuda``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from lynxkv.errors import InputError  # noqa: E402
from lynxkv.kernels import decode as kdecode  # noqa: E402
from lynxkv.kernels import encode as kencode  # noqa: E402
from lynxkv.quant import dequantize, pack_bits, quantize  # noqa: E402
from lynxkv.quant.scheme import get_scheme  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICES = [
    pytest.param("cpu", id="interp", marks=pytest.mark.skipif(not INTERPRETED, reason="Triton interpreter is off")),
    pytest.param(
        "cuda", id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="no CUDA GPU")],
    ),
]
SCHEMES = {
    "default": get_scheme("linear"),
    "mean": get_scheme("linear", centring="mean"),
    "fp32meta-C16": get_scheme("linear", meta_dtype="fp32", chunk=16, page=64),
}
SHAPES = {  # [B, H, T, D]
    "T1": (1, 3, 1, 64),
    "prime-T": (1, 2, 37, 16),
    "T=C+1": (1, 1, 33, 8),
    "T-100-D6": (2, 2, 100, 6),
    "B3-one-head": (3, 1, 65, 128),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kv_like(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = torch.randn(shape, generator=g) * (torch.rand(d, generator=g) * 3 + 0.05) + torch.randn(d, generator=g) * 2
    x[..., : max(1, d // 16)] *= 20.0
    if shape[2] > 4:
        x[:, :, 1:3] = x[:, :, 1:2]
    return x.to(dtype)


def first_mismatches(name, ref, got, k=5):
    bad = (ref.to(torch.int64) != got.to(torch.int64)) if ref.dtype == torch.uint8 else (ref.view(-1) != got.view(-1))
    idx = bad.reshape(-1).nonzero().reshape(-1)[:k].tolist()
    r, g = ref.reshape(-1), got.reshape(-1)
    return f"{name}: {int(bad.sum())} mismatches; first at flat {idx}: reference {[r[i].item() for i in idx]}, got {[g[i].item() for i in idx]}"


def poison(*tensors):
    for t in tensors:
        t.fill_(0xFF if t.dtype == torch.uint8 else float("nan"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=SCHEMES.keys())
def test_encode_bit_identical(scheme, shape, dtype, device, monkeypatch):
    x = kv_like(shape, dtype).to(device)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # every output buffer starts as 0xFF / NaN
        t = real_empty(*args, **kwargs)
        poison(t)
        return t

    monkeypatch.setattr(kencode.torch, "empty", poisoned_empty)
    monkeypatch.setattr(kencode.torch, "empty_like", lambda t: poisoned_empty(t.shape, dtype=t.dtype, device=t.device))
    a_p, r_p, off, sc = kencode.encode(x, scheme, pack=True)
    a_u, r_u, off_u, sc_u = kencode.encode(x, scheme, pack=False)
    for b in range(shape[0]):
        ref = quantize(x[b].cpu(), scheme)
        checks = {
            "offset": (ref.offset, off[b].cpu()),
            "scale": (ref.scale, sc[b].cpu()),
            "offset(unpacked run)": (ref.offset, off_u[b].cpu()),
            "anchor codes": (ref.anchor, a_u[b].cpu()),
            "residual codes": (ref.residual, r_u[b].cpu()),
            "packed anchor": (pack_bits(ref.anchor, 4), a_p[b].cpu()),
            "packed residual": (pack_bits(ref.residual, 4), r_p[b].cpu()),
        }
        for name, (want, got) in checks.items():
            if want.dtype != got.dtype or want.shape != got.shape or not torch.equal(want, got):
                worst = ""
                if name.startswith(("anchor", "residual")) and want.shape == got.shape:
                    per_chunk = (want != got).reshape(want.shape[0], -1).sum(1)
                    worst = f"; worst head {int(per_chunk.argmax())}"
                pytest.fail(f"batch {b}: " + first_mismatches(name, want, got) + worst)


# The kernel evaluates the reference's fp32 sequence, possibly with FMA contraction: a few fp32 ulps of |o| + s.
# A narrower output dtype adds at most one rounding of that dtype.
DECODE_REL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("scheme", [SCHEMES["default"], SCHEMES["fp32meta-C16"]], ids=["default", "fp32meta-C16"])
def test_decode_within_tolerance(scheme, shape, dtype, anchor_only, device):
    x = kv_like(shape, torch.float32, seed=2)
    bsz, h, t, d = shape
    if d % 2:
        pytest.skip("odd head_dim is not supported by the packed kernels")
    encs = [quantize(x[b], scheme) for b in range(bsz)]
    anchor = torch.stack([pack_bits(e.anchor, 4) for e in encs]).to(device)
    residual = torch.stack([pack_bits(e.residual, 4) for e in encs]).to(device)
    offset = torch.stack([e.offset for e in encs]).to(device)
    scale = torch.stack([e.scale for e in encs]).to(device)
    # write into a slice of a longer preallocated cache (strided T), poisoned
    cache = torch.full((bsz, h, t + 5, d), float("nan"), dtype=dtype, device=device)
    out = cache[:, :, 2 : 2 + t]
    kdecode.decode(anchor, None if anchor_only else residual, offset, scale, scheme, out)
    assert bool(torch.isnan(cache[:, :, :2]).all()) and bool(torch.isnan(cache[:, :, 2 + t :]).all()), "wrote outside out"
    for b, enc in enumerate(encs):
        ref = dequantize(enc, scheme, anchor_only=anchor_only)
        bound = DECODE_REL[dtype] * (enc.offset.float().abs() + enc.scale.float()).repeat_interleave(scheme.chunk, 1)[:, :t]
        err = (out[b].float().cpu() - ref).abs()
        bad = ~(err <= bound)
        if bool(bad.any()):
            hh, tt, dd = (int(i) for i in bad.nonzero()[0])
            pytest.fail(f"batch {b}: {int(bad.sum())} values off; worst {err.max().item():.3g}; first at "
                        f"head {hh} token {tt} channel {dd}: reference {ref[hh, tt, dd].item()}, got {out[b, hh, tt, dd].item()}")


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_and_quantize_triton(device):
    scheme = SCHEMES["default"]
    x = kv_like((2, 3, 70, 16), torch.bfloat16, seed=4).to(device)
    a, r, o, s = kencode.encode(x, scheme)
    out = torch.empty_like(x)
    kdecode.decode(a, r, o, s, scheme, out)
    step = (s.float() / 120.0).repeat_interleave(scheme.chunk, 2)[:, :, :70]  # half a full-code step is s/(A·R)
    assert bool(((out.float() - x.float()).abs() <= step * 1.01 + 2.0**-7 * x.float().abs()).all())
    enc = kencode.quantize_triton(x[1], scheme)
    ref = quantize(x[1].cpu(), scheme)
    assert torch.equal(enc.anchor.cpu(), ref.anchor) and torch.equal(enc.scale.cpu(), ref.scale)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("device", DEVICES)
def test_launchers_say_what_they_do_not_support(device):
    x = torch.randn(1, 2, 8, 6, device=device)
    with pytest.raises(InputError, match="linear compander"):
        kencode.encode(x, get_scheme("paper"))
    with pytest.raises(InputError, match="4\\+4"):
        kencode.encode(x, get_scheme("linear", anchor_bits=5))
    with pytest.raises(InputError, match="batch, kv_heads"):
        kencode.encode(x[0], get_scheme("linear"))
    with pytest.raises(InputError, match="stride 1"):
        kencode.encode(x.transpose(2, 3), get_scheme("linear"))
    with pytest.raises(InputError, match="bf16, fp16 or fp32"):
        kencode.encode(x.double(), get_scheme("linear"))
    bad = x.clone()
    bad[0, 1, 3, 2] = float("inf")
    with pytest.raises(InputError, match="inf or NaN"):
        kencode.encode(bad, get_scheme("linear"))
    a, r, o, s = kencode.encode(x, get_scheme("linear"))
    with pytest.raises(InputError, match="residual"):
        kdecode.decode(a, r[:, :-1].contiguous(), o, s, get_scheme("linear"), torch.empty_like(x))
    with pytest.raises(InputError, match="out must be"):
        kdecode.decode(a, r, o, s, get_scheme("linear"), torch.empty_like(x).to(torch.int32))



COMPILE_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lynxkv.kernels import encode as kencode
sig = {"x_ptr": "*bf16", "off_ptr": "*fp16", "scale_ptr": "*fp16", "a_ptr": "*u8", "r_ptr": "*u8",
       **{k: "i32" for k in ("H", "T", "D", "NC", "D2", "sxb", "sxh", "sxt")},
       **{k: "constexpr" for k in ("CHUNK", "LOG2_C", "HALF_D", "BLOCK_D", "MEAN", "META_FP16", "PACK", "A", "R")}}
cx = {"CHUNK": 32, "LOG2_C": 5, "HALF_D": 64, "BLOCK_D": 128, "MEAN": True, "META_FP16": True, "PACK": True, "A": 15, "R": 16}
# what the launcher's specialisation sees for head_dim 128 and 16-byte aligned buffers: divisible by 16
attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name not in ("H",) and sig[name] != "constexpr"}
try:
    src = ASTSource(fn=kencode._encode_kernel, signature=sig, constexprs=cx, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
except Exception as exc:
    print(json.dumps({"skip": f"{type(exc).__name__}: {exc}"[:300]})); sys.exit(0)
print(json.dumps({k: ptx.count(k) for k in ("div.rn.f32", "div.approx", "div.full", "fma.rn.f32", "ld.global.v4", "st.global.v4")}))
"""


def test_encode_compiles_for_sm90_with_exact_division_and_no_fma():
    """The encode's bit-exactness on a GPU rests on correctly rounded division and no FMA contraction: compile
    it to PTX for an H100/H200 (sm_90; Triton ships ptxas, no GPU needed) and read the instructions."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SM90], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in counts:
        pytest.skip(f"cannot compile for sm_90 here: {counts['skip']}")
    assert counts["div.rn.f32"] > 0 and counts["div.approx"] == 0 and counts["div.full"] == 0, counts
    assert counts["fma.rn.f32"] == 0, counts
    assert counts["ld.global.v4"] > 0 and counts["st.global.v4"] > 0, f"loads/stores not vectorised: {counts}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", [SCHEMES["default"], SCHEMES["mean"]], ids=["midrange", "mean"])
def test_encode_constant_and_signed_zero_chunks(scheme, device):
    """Degenerate chunks: all -0.0 (the mean must keep the sign, as the reference's tree sum does), constant
    values (scale 0, codes at the centre), and a tail chunk of one token."""
    x = torch.zeros((1, 2, 33, 4))
    x[0, 0] = -0.0
    x[0, 1, :, 1] = 3.25
    x[0, 1, :, 2] = -7.0e-3
    x = x.to(device)
    a, r, off, sc = kencode.encode(x, scheme, pack=False)
    ref = quantize(x[0].cpu(), scheme)
    for name, want, got in (("offset", ref.offset, off[0]), ("scale", ref.scale, sc[0]),
                            ("anchor", ref.anchor, a[0]), ("residual", ref.residual, r[0])):
        got = got.cpu()
        same_bits = torch.equal(want.view(torch.int16), got.view(torch.int16)) if want.dtype == torch.float16 else torch.equal(want, got)
        assert same_bits, first_mismatches(name, want.view(torch.int16) if want.dtype == torch.float16 else want,
                                           got.view(torch.int16) if got.dtype == torch.float16 else got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [SHAPES[k] for k in ("T1", "prime-T", "T-100-D6")], ids=["T1", "prime-T", "T-100-D6"])
@pytest.mark.parametrize("scheme", [get_scheme("default"), get_scheme("paper"),
                                    get_scheme("default", chunk=4, page=8).replace(sink_tokens=10),
                                    get_scheme("default", chunk=4, page=8, extremes="range").replace(sink_tokens=10)],
                         ids=["default", "paper", "C4-S10", "range-C4-S10"])
def test_decode_is_the_reference_bit_for_bit(scheme, shape, dtype, device):
    """Through the reference's level table (any compander and grid), keys and values per channel, the sink tokens
    from the full code when decoding the anchor alone: the entry's GPU path gives the reference's values exactly,
    written into a poisoned slice of a longer cache."""
    x = kv_like(shape, torch.float32, seed=5)
    bsz, h, t, d = shape
    for b in range(bsz):
        for kind in ("key", "value"):
            enc = quantize(x[b], scheme, kind)
            for anchor_only in (False, True):
                want = dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype)
                cache = torch.full((h, t + 3, d), float("nan"), dtype=dtype, device=device)
                a, r = pack_bits(enc.anchor, 4).to(device), pack_bits(enc.residual, 4).to(device)
                kdecode.decode(a.view(1, -1), r.view(1, -1), enc.offset.to(device).unsqueeze(0),
                               enc.scale.to(device).unsqueeze(0), scheme, cache[:, 1:1 + t].unsqueeze(0), kind=kind,
                               anchor_only=anchor_only, sinks=enc.sinks)
                got = cache[:, 1:1 + t].cpu()
                assert bool(cache[:, 0].isnan().all()) and bool(cache[:, -2:].isnan().all()), "wrote outside out"
                if dtype == torch.float32 or device == "cuda":
                    if not torch.equal(want, got):
                        pytest.fail(f"{kind} anchor_only={anchor_only}: " + first_mismatches("values", want, got))
                else:  # the interpreter's fp32 -> bf16 conversion is not round-to-nearest-even: one bf16 step
                    assert bool(((got.float() - want.float()).abs() <= 2.0**-7 * want.float().abs()).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 96, 80], ids=["D64", "D128", "D96-b32", "D80-b16"])
def test_decode_rotates_keys_back_as_the_reference(d, dtype, device):
    """Rotated keys (blocks of 32 and 16 channels for D = 96 and 80) from bf16 inputs with outlier
    channels and adversarial magnitudes: the full code and the anchor alone with sink tokens, written into a
    poisoned slice, are the reference's values bit for bit (the rotation back is fp32 before the cast)."""
    scheme = get_scheme("default")  # keys rotated, 4 sink tokens
    x = kv_like((1, 2, 45, d), torch.bfloat16, seed=d)[0]
    x[0, 5] = torch.tensor([(-1.0) ** i * 2.0**12 for i in range(d)])  # sums that cancel exactly
    x[1, 7] = 2.0**-120  # tiny: subnormal intermediates
    enc = quantize(x, scheme)
    assert enc.rotated and enc.sinks == 4
    a, r = pack_bits(enc.anchor, 4).to(device), pack_bits(enc.residual, 4).to(device)
    for anchor_only in (False, True):
        want = dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype)
        cache = torch.full((2, 48, d), float("nan"), dtype=dtype, device=device)
        kdecode.decode(a.view(1, -1), r.view(1, -1), enc.offset.to(device).unsqueeze(0),
                       enc.scale.to(device).unsqueeze(0), scheme, cache[:, 1:46].unsqueeze(0), kind="key",
                       anchor_only=anchor_only, sinks=enc.sinks)
        assert bool(cache[:, 0].isnan().all()) and bool(cache[:, -2:].isnan().all()), "wrote outside out"
        got = cache[:, 1:46].cpu()
        if not torch.equal(want.view(torch.int16) if dtype == torch.bfloat16 else want,
                           got.view(torch.int16) if dtype == torch.bfloat16 else got):
            pytest.fail(f"anchor_only={anchor_only}: " + first_mismatches("values", want, got))
