"""Scheme parameters: one clear error for a bad one, and every scheme the command line accepts round-trips
within its documented error bound (``lynxkv.quant.error_bound``) through the quantizer entry."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lynxkv.errors import SchemeError
from lynxkv.quant import dequantize, error_bound, quantize
from lynxkv.quant.scheme import MAX_ALPHA, MIN_ALPHA, PRESETS, get_scheme


@pytest.mark.parametrize("alpha", [5e-324, 1e-300, 1e-4, -1.0, float("nan"), float("inf"), 1e5],
                         ids=["subnormal", "tiny", "below-min", "negative", "nan", "inf", "above-max"])
def test_bad_alpha_is_one_clear_error(alpha):
    with pytest.raises(SchemeError, match=r"^alpha: expected 0.001 <= alpha <= 65504"):
        get_scheme("default", alpha=alpha)


@pytest.mark.parametrize("rotation", ["Hadamard", "", "hadamard ", 1])
def test_bad_key_rotation_is_one_clear_error(rotation):
    with pytest.raises(SchemeError, match=r"^key_rotation: expected one of \('none', 'hadamard'\)"):
        get_scheme("default", key_rotation=rotation)


@pytest.mark.parametrize("extremes", ["Range", "", "edge", "midpoint "])
def test_bad_extremes_is_one_clear_error(extremes):
    with pytest.raises(SchemeError, match=r"^extremes: expected one of \('midpoint', 'range'\)"):
        get_scheme("default", extremes=extremes)


def test_extremes_range_is_for_the_nested_grid_only():
    with pytest.raises(SchemeError, match=r"^extremes: 'range' applies to the nested grid only"):
        get_scheme("paper", extremes="range")


@st.composite
def cli_schemes(draw):
    """What ``lynxkv encode --scheme S --page P --chunk C --alpha A --anchor-bits B --key-rotation R --extremes E``
    accepts."""
    name = draw(st.sampled_from(sorted(PRESETS)))
    chunk = draw(st.sampled_from([None, 1, 4, 16, 32, 64, 128]))
    page = draw(st.sampled_from([None, 64, 256, 512]))
    alpha = draw(st.one_of(st.none(), st.floats(math.log(MIN_ALPHA), math.log(MAX_ALPHA)).map(math.exp)))
    anchor_bits = draw(st.sampled_from([None, 1, 3, 4, 5, 7]))
    key_rotation = draw(st.sampled_from([None, "none", "hadamard"]))
    extremes = draw(st.sampled_from([None, "midpoint", "range"]))
    try:
        return get_scheme(name, page=page, chunk=chunk, alpha=alpha, anchor_bits=anchor_bits,
                          key_rotation=key_rotation, extremes=extremes)
    except SchemeError:  # rejected with one error line: not a scheme the CLI accepts
        assume(False)


@settings(max_examples=60, deadline=None)
@given(scheme=cli_schemes(), seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([1e-3, 1.0, 50.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), tokens=st.integers(1, 90),
       head_dim=st.sampled_from([1, 6, 16, 80, 96]))
def test_every_accepted_scheme_round_trips_within_its_bound(scheme, seed, spread, dtype, tokens, head_dim):
    """Keys, rotated or not (head_dim 80 and 96: blocks of 16 and 32 channels; 1: the identity)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((2, tokens, head_dim), generator=g) * spread
         + torch.randn(head_dim, generator=g) * spread).to(dtype)
    x[:, :, 0] *= 30  # an outlier channel, which the rotation spreads over its block
    enc = quantize(x, scheme)
    for anchor_only in (False, True):
        err = (dequantize(enc, scheme, anchor_only=anchor_only) - x.float()).abs()
        bound = error_bound(enc, scheme, anchor_only=anchor_only)
        worst = int(torch.argmax(err - bound))
        assert bool((err <= bound).all()), (
            f"{scheme.describe()} anchor_only={anchor_only}: element {worst} error {err.flatten()[worst]:.3g} "
            f"> bound {bound.flatten()[worst]:.3g}")
