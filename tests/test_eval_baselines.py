"""The codec registry: bits per element, hand-checked round trips, and the error ordering on KV-like data."""

from __future__ import annotations

import pytest
import torch

from lynxkv.errors import InputError
from lynxkv.eval import baselines
from lynxkv.eval.baselines import bits_kv, roundtrip_kv
from lynxkv.eval.metrics import vnmse_global
from lynxkv.quant.scheme import get_scheme


def kv_like(seed: int = 0, h: int = 2, t: int = 256, d: int = 64) -> torch.Tensor:
    """Gaussian rows with a few large outlier channels, as in real keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(h, t, d, generator=g)
    x[:, :, :3] *= 12.0
    x += torch.randn(1, 1, d, generator=g) * 2.0
    return x


def test_registry_holds_every_required_codec():
    names = set(baselines.registry())
    required = {
        "fp32", "bf16", "fp8-e4m3", "int8-tensor", "int4-tensor", "int8-g64", "int4-g64", "kivi4", "kivi2",
        "lynx-default", "lynx-default-anchor", "lynx-1.3", "lynx-1.2", "lynx-1.2-anchor", "lynx-paper", "lynx-paper-anchor",
        "lynx-3+5", "lynx-3+5-anchor", "lynx-5+3", "lynx-5+3-anchor", "lynx-6+2", "lynx-6+2-anchor",
    }  # fmt: skip
    assert required <= names


def test_bits_per_element_include_metadata():
    reg = baselines.registry()
    shape = (2, 64, 64)
    n = 2 * 64 * 64
    assert bits_kv(reg["bf16"], shape, "key") == 16.0
    assert bits_kv(reg["fp8-e4m3"], shape, "key") == pytest.approx(8 + 32 / n)
    assert bits_kv(reg["int4-tensor"], shape, "key") == pytest.approx(4 + 32 / n)
    assert bits_kv(reg["int4-g64"], shape, "key") == pytest.approx(4 + 32 / 64)
    assert bits_kv(reg["kivi2"], shape, "key") == pytest.approx(2 + 32 / 32)
    assert bits_kv(reg["kivi2"], shape, "value") == pytest.approx(2 + 32 / 32)
    sinks = 4 * 4 / 64  # the default's 4 sink tokens carry their 4-bit residual in the anchor (and the residual)
    assert bits_kv(reg["lynx-default"], shape, "key") == pytest.approx(8 + 32 / 32 + sinks)
    assert bits_kv(reg["lynx-default-anchor"], shape, "key") == pytest.approx(4 + 32 / 32 + sinks)
    assert bits_kv(reg["lynx-linear-anchor"], shape, "value") == pytest.approx(4 + 32 / 32)
    assert bits_kv(reg["lynx-3+5-anchor"], shape, "key") == pytest.approx(3 + 1 + 4 * 5 / 64)
    # a 40-token tail still pays for two whole chunks of key metadata (values per channel: two groups of 32)
    assert bits_kv(reg["lynx-default"], (2, 40, 64), "key") == pytest.approx(8 + (32 * 2 / 40 + 1) / 2 + 4 * 4 / 40)


def test_int_per_tensor_and_fp8_round_trips_by_hand():
    reg = baselines.registry()
    x = torch.tensor([[[-2.0, 0.6, -0.9, 2.0]]])
    # INT4: M = 7, s = 2/7; 0.6/s = 2.1 -> 2, -0.9/s = -3.15 -> -3
    torch.testing.assert_close(reg["int4-tensor"].roundtrip(x), torch.tensor([[[-2.0, 4 / 7, -6 / 7, 2.0]]]))
    y = torch.tensor([[[448.0, 1.0, -2.0, 0.0]]])  # scale 1: all exactly representable in e4m3
    torch.testing.assert_close(reg["fp8-e4m3"].roundtrip(y), y)
    z = torch.tensor([[[448.0, 1.0625]]])  # 1.0625 is between e4m3 neighbours 1.0 and 1.125 -> ties to even
    assert float(reg["fp8-e4m3"].roundtrip(z)[0, 0, 1]) == 1.0
    assert torch.equal(reg["int8-tensor"].roundtrip(torch.zeros(1, 2, 3)), torch.zeros(1, 2, 3))


def test_minmax_groups_are_exact_on_their_own_grid():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    torch.testing.assert_close(baselines.minmax_roundtrip(x, 2, dim=1), x)
    const = torch.full((1, 4), 5.0)
    torch.testing.assert_close(baselines.minmax_roundtrip(const, 2, dim=1), const)


def test_kivi_groups_keys_per_channel_and_values_per_token():
    kivi = baselines.registry()["kivi2"]
    d = torch.arange(64, dtype=torch.float32) * 10.0
    channel_const = d.expand(1, 64, 64).clone()  # constant along tokens, varies over channels
    # keys group tokens within a channel: a per-channel constant is exact
    torch.testing.assert_close(roundtrip_kv(kivi, channel_const, "key"), channel_const)
    # values group channels within a token: a 0..630 ramp on 2 bits is not
    assert not torch.allclose(roundtrip_kv(kivi, channel_const, "value"), channel_const)
    token_const = channel_const.transpose(1, 2).contiguous()  # constant along channels
    torch.testing.assert_close(roundtrip_kv(kivi, token_const, "value"), token_const)


def test_error_ordering_on_kv_like_data():
    x = kv_like()
    err = {name: vnmse_global(x, roundtrip_kv(c, x, "key")) for name, c in baselines.registry().items()}
    assert err["fp32"] == 0.0
    # the paper's ordering: per-tensor INT4 >> per-tensor INT8 >> lynx full
    assert err["int4-tensor"] > 10 * err["int8-tensor"] > 10 * err["lynx-default"]
    assert err["bf16"] < err["int8-g64"] < err["int4-g64"]
    assert err["kivi2"] > err["kivi4"]
    for name in ("default", "paper", "3+5", "5+3", "6+2"):
        assert err[f"lynx-{name}-anchor"] > err[f"lynx-{name}"]
    # more anchor bits, better anchor
    assert err["lynx-3+5-anchor"] > err["lynx-default-anchor"] > err["lynx-5+3-anchor"] > err["lynx-6+2-anchor"]


def test_tail_tokens_and_odd_shapes_round_trip_with_the_right_shape():
    x = kv_like(1, h=3, t=37, d=24)
    for codec in baselines.registry().values():
        for kind in ("key", "value"):
            y = roundtrip_kv(codec, x, kind)
            assert y.shape == x.shape and y.dtype == torch.float32, codec.name
            assert bool(torch.isfinite(y).all()), codec.name


def test_sweep_and_selection():
    sweep = baselines.sweep_codecs()
    for name in ("default", "linear", "alpha=255", "C=16", "C=64", "P=128", "P=512", "split=6+2"):
        assert name in sweep and f"{name}-anchor" in sweep
    assert sweep["C=64"].scheme.chunk == 64 and sweep["alpha=10"].scheme.alpha == 10.0
    assert sweep["linear"].scheme.compander == "linear" and sweep["default"].scheme.alpha == 0.5
    assert sweep["default"].scheme.key_rotation == "hadamard" and sweep["keys=none"].scheme.key_rotation == "none"
    assert sweep["keys=none"].scheme.replace(key_rotation="hadamard") == sweep["default"].scheme
    assert sweep["alpha=1"].scheme.alpha == 1.0 and sweep["alpha=1"].scheme.key_rotation == "hadamard"
    old = baselines.registry()["lynx-1.2-anchor"]  # an earlier default, kept by name
    assert old.anchor_only and old.scheme == get_scheme("default", alpha=1.0, key_rotation="none", extremes="midpoint")
    assert baselines.registry()["lynx-1.3"].scheme == get_scheme("default", extremes="midpoint")
    assert sweep["extremes=midpoint"].scheme.replace(extremes="range") == sweep["default"].scheme
    chosen = baselines.select("bf16, lynx-default-anchor")
    assert [c.name for c in chosen] == ["bf16", "lynx-default-anchor"]
    with pytest.raises(InputError, match="nope"):
        baselines.select("bf16,nope")
