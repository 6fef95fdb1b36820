"""The Hadamard key rotation: the pinned butterfly against a plain loop that follows the spec's
text, the exact inverse, and every decode path (reference, fast CPU, the entry, the cache readers) bit for bit
with the reference on rotated keys, anchor-only with sink tokens and bf16 output included."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import lynxkv.quant as entry
from lynxkv.cache import open_cache, save_cache
from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.quant import fast, reference, rotation
from lynxkv.quant.scheme import get_scheme
from lynxkv.stream import open_progressive

HEAD_DIMS = {"D64": 64, "D128": 128, "D96-b32": 96, "D80-b16": 80, "D1": 1, "D6-b2": 6}
ROTATED = get_scheme("default")  # alpha 0.5, values per channel, 4 sinks, keys rotated
assert ROTATED.rotated("key") and not ROTATED.rotated("value")


def spec_butterfly(row: list[float], b: int) -> list[float]:
    """spec/FORMAT.md §9.2 read literally: numpy-free scalar fp32 arithmetic, pair by pair."""
    x = [torch.tensor(v, dtype=torch.float32) for v in row]
    h = 1
    while h < b:
        for i in range(len(x)):
            if i % (2 * h) < h:
                x[i], x[i + h] = x[i] + x[i + h], x[i] - x[i + h]
        h *= 2
    return [float(v) for v in x]


def adversarial_rows(d: int, seed: int = 0) -> torch.Tensor:
    """Rows that stress fp32 rounding: huge and tiny magnitudes side by side, subnormals, signed zeros, ties."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(d, generator=g) * 10 ** torch.randint(-6, 7, (d,), generator=g).float()]
    rows.append(torch.full((d,), 2.0**-140))  # subnormal sums and scalings
    rows.append(torch.tensor([(-1.0) ** i * (1 + 2.0**-23) * 2.0**40 for i in range(d)]) + 1.0)
    rows.append(torch.tensor([-0.0 if i % 2 else 0.0 for i in range(d)]))
    rows.append(torch.tensor([1.0 + i * 2.0**-23 for i in range(d)]))  # sums round to even
    return torch.stack(rows)


@pytest.mark.parametrize("d", HEAD_DIMS.values(), ids=HEAD_DIMS.keys())
def test_butterfly_is_the_spec_arithmetic(d):
    b = rotation.block_size(d)
    assert b == d & -d and d % b == 0 and b & (b - 1) == 0
    rows = adversarial_rows(d)
    got = rotation.butterfly(rows)
    for r, g in zip(rows.tolist(), got):
        want = torch.tensor(spec_butterfly(r, b), dtype=torch.float32)
        assert torch.equal(g.view(torch.int32), want.view(torch.int32)), (d, r[:4])


def spec_rotation_vector() -> dict[str, torch.Tensor]:
    """The worked row of spec/FORMAT.md §9.2 (```fp32 example=rotation-d4```): name -> fp32 ``[4]``."""
    text = (Path(__file__).resolve().parents[1] / "spec" / "FORMAT.md").read_text(encoding="utf-8")
    body = re.search(r"```fp32 example=rotation-d4\n(.*?)```", text, re.S).group(1)
    rows = {}
    for line in body.strip().splitlines():
        name, words = line.split(":", 1)
        bits = [int(w, 16) for w in words.split()]
        rows[name.strip()] = torch.tensor([b - (1 << 32) if b >> 31 else b for b in bits], dtype=torch.int32).view(
            torch.float32)
    return rows


def test_the_spec_worked_row_pins_the_stage_order_and_the_scalings():
    v = spec_rotation_vector()
    assert set(v) == {"x", "butterfly", "y", "rotated-back"}
    x = v["x"].view(1, 1, 4)
    pairs = [(rotation.butterfly(v["x"]), v["butterfly"]), (rotation.rotate(x), v["y"]),
             (rotation.unrotate(v["y"]), v["rotated-back"]),
             (torch.tensor(spec_butterfly(v["x"].tolist(), 4)), v["butterfly"])]
    if fast.available():
        pairs.append((fast.rotate(x), v["y"]))
    for got, want in pairs:
        assert torch.equal(got.reshape(4).view(torch.int32), want.view(torch.int32)), (got, want)
    a = v["x"]  # the stages in the other order (h = 2, then h = 1) round the first sum the other way
    a = torch.stack([a[0] + a[2], a[1] + a[3], a[0] - a[2], a[1] - a[3]])
    a = torch.stack([a[0] + a[1], a[0] - a[1], a[2] + a[3], a[2] - a[3]])
    assert float(a[0]) == 1 + 2.0**-23 != float(v["butterfly"][0])


@pytest.mark.parametrize("d", HEAD_DIMS.values(), ids=HEAD_DIMS.keys())
def test_rotation_is_orthonormal_and_its_inverse_exact_on_integers(d):
    k, back = rotation.shifts(d)
    b = rotation.block_size(d)
    assert k + back == b.bit_length() - 1 and k == (b.bit_length() - 1) // 2
    x = torch.randint(-1000, 1000, (3, 5, d)).float()  # small integers: every sum is exact
    assert torch.equal(rotation.unrotate(rotation.rotate(x)), x)
    y = torch.randn(4, d, dtype=torch.float64)
    h = rotation.butterfly(torch.eye(d, dtype=torch.float32)).double() / b**0.5
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64))  # orthonormal within blocks
    torch.testing.assert_close(rotation.rotate(y.float()).double() * 2.0**k / b**0.5, (y.float().double() @ h.T),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not fast.available(), reason="the compiled kernels were not built")
@pytest.mark.parametrize("d", HEAD_DIMS.values(), ids=HEAD_DIMS.keys())
def test_compiled_rotation_is_the_reference_bit_for_bit(d):
    rows = adversarial_rows(d, seed=d)
    x = torch.cat([rows, kv_like(1, 30, d, seed=d)[0]]).view(1, -1, d)
    for dtype in (torch.float32, torch.bfloat16):
        xt = x.to(dtype)
        for view in (xt, xt[:, 2:-3]):  # a token slice: strided rows
            assert torch.equal(fast.rotate(view).view(torch.int32), rotation.rotate(view).view(torch.int32)), dtype


def test_bf16_input_is_widened_exactly_before_the_rotation():
    x = adversarial_rows(64, seed=3).to(torch.bfloat16).view(1, 5, 64)
    assert torch.equal(rotation.rotate(x), rotation.rotate(x.float()))
    scheme = ROTATED.replace(meta_dtype="fp32")  # magnitudes past the fp16 range
    enc = reference.quantize(x, scheme)
    assert all(torch.equal(getattr(enc, f), getattr(reference.quantize(x.float(), scheme), f))
               for f in ("anchor", "residual", "offset", "scale"))


def kv_like(h: int, t: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(h, t, d, generator=g) * (torch.rand(d, generator=g) * 3 + 0.05) + torch.randn(d, generator=g)
    x[..., : max(1, d // 16)] *= 20.0  # outlier channels: what the rotation is for
    return x


@pytest.mark.skipif(not fast.available(), reason="the compiled kernels were not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS.values(), ids=HEAD_DIMS.keys())
def test_fast_decode_rotates_back_bit_for_bit(d, dtype):
    """The compiled pass (butterfly fused into the decode) against the reference, full and anchor-only (the
    sink tokens from the full code), unpacked and packed, into poisoned outputs."""
    x = kv_like(2, 70, d, seed=d) if d > 1 else kv_like(2, 70, 1)
    enc = entry.quantize(x, ROTATED)
    assert enc.rotated and enc.sinks == 4
    for anchor_only in (False, True):
        want = reference.dequantize(enc, ROTATED, anchor_only=anchor_only, dtype=dtype)
        out = torch.full(x.shape, float("nan"), dtype=dtype)
        got = entry.dequantize(enc, ROTATED, anchor_only=anchor_only, out=out)
        assert got is out and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (d, anchor_only)
        if d % 2 == 0:
            a, r = entry.pack_bits(enc.anchor, 4), entry.pack_bits(enc.residual, 4)
            packed = entry.dequantize_packed(a, None if anchor_only else r, enc.offset, enc.scale, x.shape, ROTATED,
                                             dtype=dtype)
            # the packed arrays carry no sink residual: every token from its anchor code
            want0 = reference.dequantize(dataclasses.replace(enc, sinks=0), ROTATED, anchor_only=anchor_only,
                                         dtype=dtype)
            assert torch.equal(packed.view(torch.uint8), want0.view(torch.uint8)), (d, anchor_only, "packed")


@pytest.mark.parametrize("d", [64, 96, 80, 5], ids=["D64", "D96", "D80", "D5-b1"])
def test_caches_of_rotated_keys_load_as_the_reference_decodes(tmp_path, d):
    """``load_kv`` (full and anchor-only) and the progressive reader give the reference's bf16 values of the
    file's own codes; the file sets the keys' flag (KEY_ROTATION) and a non-rotating scheme's file does not. An odd head_dim (blocks of
    one channel: the identity) still sets the flag and takes the unpacked page path."""
    kv = [(kv_like(2, 300, d, seed=i).to(torch.bfloat16), kv_like(2, 300, d, seed=10 + i).to(torch.bfloat16))
          for i in range(2)]
    save_cache(tmp_path / "r.lynx", kv, ROTATED)
    with open_cache(tmp_path / "r.lynx") as cache:
        assert cache.header.flags & c.FLAG_KEY_ROTATION and cache.info.scheme == ROTATED
        for anchor_only in (False, True):
            got = cache.load_kv(anchor_only=anchor_only)
            enc = cache.load_encoded(anchor_only=anchor_only)
            for (k, v), (ek, ev), (k0, _) in zip(got, enc.layers, kv):
                assert ek.rotated and not ev.rotated
                assert torch.equal(k, reference.dequantize(ek, ROTATED, anchor_only=anchor_only, dtype=torch.bfloat16))
                assert torch.equal(v, reference.dequantize(ev, ROTATED, anchor_only=anchor_only, dtype=torch.bfloat16))
                assert float((k.float() - k0.float()).abs().max()) < 0.1 * float(k0.float().abs().max())
        full, anchor = cache.load_kv(dtype=torch.float32), cache.load_kv(anchor_only=True, dtype=torch.float32)
    with open_progressive(tmp_path / "r.lynx") as load:  # page by page as the bytes arrive, fp32 out
        for got, want in ((load.wait_anchor(30), anchor), (load.residual.result(30), full)):
            for (k, v), (kw, vw) in zip(got, want):
                assert torch.equal(k, kw) and torch.equal(v, vw)
    save_cache(tmp_path / "p.lynx", kv, ROTATED.replace(key_rotation="none", extremes="midpoint"))
    with open_cache(tmp_path / "p.lynx") as cache:
        assert not cache.header.flags & c.FLAG_KEY_ROTATION and not cache.load_encoded().layers[0][0].rotated


def test_finite_keys_whose_rotation_overflows_are_one_clear_error():
    x = torch.full((1, 2, 4), 1e38)  # four of them sum past the fp32 range
    scheme = ROTATED.replace(meta_dtype="fp32")
    with pytest.raises(InputError, match="overflow fp32 when rotated"):
        entry.quantize(x, scheme)
    with pytest.raises(InputError, match="inf or NaN"):
        entry.quantize(torch.full((1, 2, 4), float("nan")), scheme)
    entry.quantize(x, scheme, "value")  # values are not rotated


@pytest.mark.parametrize("d", HEAD_DIMS.values(), ids=HEAD_DIMS.keys())
def test_error_bound_holds_on_adversarial_rows(d):
    """error_bound of rotated keys (docs/format.md, "Error bound") on rows whose butterflies round: cancelling sums of
    2^40-sized values, subnormal sums, ties; per token (C = 1: each row its own metadata) and per chunk."""
    x = torch.stack([adversarial_rows(d, seed) for seed in range(4)]).view(2, 10, d)
    for scheme in (ROTATED.replace(meta_dtype="fp32"), ROTATED.replace(meta_dtype="fp32", chunk=1, page=1)):
        enc = entry.quantize(x, scheme)
        for anchor_only in (False, True):
            err = (entry.dequantize(enc, scheme, anchor_only=anchor_only) - x).abs()
            bound = reference.error_bound(enc, scheme, anchor_only=anchor_only)
            worst = int(torch.argmax(err - bound))
            assert bool((err <= bound).all()), (scheme.chunk, anchor_only, float(err.flatten()[worst]),
                                                float(bound.flatten()[worst]))
