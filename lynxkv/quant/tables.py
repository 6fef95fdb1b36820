"""The tables the fast CPU kernels read, built from the reference itself so that their codes and decoded values
are the reference's bit for bit (:mod:`lynxkv.quant.fast` runs the kernels on them).

Why it is exact:

- **Codes from a threshold table.** The code of an element depends only on its normalised value
  ``u = fl(fl(x - o) / s)`` in ``[-1, 1]``, through a monotone step function (compander, then rounding). Read as
  an integer, ``key = bits(u) ^ ((bits(u) >> 31) & 0x7FFFFFFF)`` orders the fp32 values of ``[-1, 1]``, so the
  function is fixed by the (at most 255) keys where the code steps up. :func:`code_table` finds each of them by
  bisection over the keys, evaluating the reference's own :func:`~lynxkv.quant.reference.codes_of_u`, and
  stores per bucket of ``2^S`` consecutive keys, in one 32-bit entry, the code at the bucket's start, the low
  bits of the one step inside it and the code from there on: ``code = key mod 2^S >= low[b] ? top[b] : base[b]``
  with ``b = key >> S``. The steps of any scheme are more than ``2^16`` keys apart (the code steps at most once
  per ``1/127.5`` of ``z``, and the compander's slope is bounded), so ``S = 16`` always fits and the table has
  32K entries (128 KiB, in L2). The AVX2 encode looks every code up there (the exact ``u`` by a division, one
  gather per 8 elements): no compander is evaluated per element, and the α-law default costs what the linear
  scheme costs. The portable loops take a first pass through an fp32 compander and look up only the elements
  near a step (:func:`approximation`).
  ``benchmarks/check_code_identity.py`` compares the table with the reference over every fp32 ``u`` in
  ``[-1, 1]``; the tests check the neighbourhood of every threshold.
- **Metadata from the group's range.** Rounding is monotone and symmetric, so
  ``max_i |fl(x_i - o)| = max(fl(max - o), fl(o - min))``: the pass that reads a unit finds each group's max and
  min (a group: C tokens of one channel, or for values per channel C channels of one token, read in place), the
  reference's rounding of offset and scale runs on those. The max and min are taken over integer order keys
  (they vectorise); a group of zeros keeps its first zero's sign, as the reference's running max and min do.
  (``mean`` centring takes the reference's pinned tree sum.)
- **Decoding through a level table.** The reference decodes ``x̂ = o + s·û(code)``; ``û`` of all 256 codes (or
  of every anchor) is computed once by the reference itself, so ``fl(o + fl(s·levels[code]))`` is the
  reference's value bit for bit, rounded to bf16 (nearest even) or kept in fp32 in the same loop.
- **Rotated keys**: the Walsh–Hadamard butterfly of :mod:`lynxkv.quant.rotation`, the same fp32
  additions on the same operands (so the same bits), runs per row in the encode pass (before the range), in the
  decode pass (after ``o + s·û``, before the cast) and in :func:`rotate`.
- **Vectors.** Where the CPU has AVX2 (checked at run time) the rows of the default layout run on 8-lane vectors:
  lanes do the IEEE operations a scalar loop does, and the kernels are compiled without fused multiply-add, so
  the bits do not depend on the path; the tests run both against the reference.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from lynxkv.errors import InputError
from lynxkv.quant import reference
from lynxkv.quant.scheme import Scheme

KEY_MIN = -1065353217
KEY_MAX = 1065353216
#: log2 of the keys per table bucket.
TABLE_SHIFT = 16
#: ``log(1 + f) ≈ f - f²/2 + f³·P(f)`` on ``f`` in [√½ - 1, √2 - 1] (a degree-5 Chebyshev fit): within 8e-7 of
#: the log, plus fp32 rounding; the kernels' margin assumes 2^-19·max(1, log y).
LOG_POLY = (0.33333557528147356, -0.24994054257805176, 0.19955300260002215, -0.1694757798896947,
            0.15702601920540465, -0.10606678495069904)
LOG_ERROR = 2.0**-19


def u_of_key(keys: torch.Tensor) -> torch.Tensor:
    """fp32 values of int64 keys in ``[KEY_MIN, KEY_MAX]``."""
    bits = torch.where(keys >= 0, keys, keys ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32)


def _code_of_key(keys: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    a, r = reference.codes_of_u(u_of_key(keys.clamp(KEY_MIN, KEY_MAX)), scheme)
    return reference.join_code(a, r, scheme).to(torch.int64)


def code_steps(scheme: Scheme) -> torch.Tensor:
    """The keys (int64, ascending) where the reference's 8-bit code steps up, by bisection over ``[KEY_MIN,
    KEY_MAX]``: the code of a key is that of the last step at or below it (or of ``KEY_MIN``)."""
    targets = torch.arange(1, 256, dtype=torch.int64)
    lo = torch.full_like(targets, KEY_MIN - 1)  # code(lo) < target (conceptually; lo is below the range)
    hi = torch.full_like(targets, KEY_MAX + 1)  # code(hi) >= target
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        up = _code_of_key(mid, scheme) >= targets
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid)
    return torch.unique(hi[(hi > KEY_MIN) & (hi <= KEY_MAX)])


@functools.lru_cache(maxsize=32)
def code_table(scheme: Scheme) -> tuple[np.ndarray, int]:
    """``(table uint32 [n], offset)``: bucket ``b = (key >> TABLE_SHIFT) + offset`` holds the low 16 bits of the
    one code step inside it (0 where there is none), the code below that step (bits 16-23) and the code from it
    on (bits 24-31): a key's code is the second where its low 16 bits reach the first, else the first (the
    reference's 8-bit code). One 32-bit load per element."""
    steps = code_steps(scheme)
    buckets = steps >> TABLE_SHIFT
    if buckets.numel() != torch.unique(buckets).numel():  # impossible for the schemes Scheme accepts
        raise InputError(f"scheme {scheme.describe()}: two code steps closer than 2^{TABLE_SHIFT} fp32 values")
    b_min, b_max = KEY_MIN >> TABLE_SHIFT, KEY_MAX >> TABLE_SHIFT
    starts = (torch.arange(b_min, b_max + 1, dtype=torch.int64) << TABLE_SHIFT).clamp(min=KEY_MIN)
    step = starts.clone()  # where a bucket has no step inside, its start (the low bits are not looked at)
    has = torch.zeros(starts.shape, dtype=torch.bool)
    inside = steps > starts[buckets - b_min]  # a step exactly at a bucket's start is its base code
    step[buckets[inside] - b_min] = steps[inside]
    has[buckets[inside] - b_min] = True
    base = _code_of_key(starts, scheme)
    top = torch.where(has, _code_of_key(step, scheme), base)
    low = torch.where(has, step & 0xFFFF, 0)  # no step: base == top, either way
    table = (low | (base << 16) | (top << 24)).to(torch.int64).numpy().astype(np.uint32)
    return table, -b_min


@functools.lru_cache(maxsize=64)
def level_table(scheme: Scheme, anchor_only: bool) -> np.ndarray:
    """fp32 ``û`` of every code (``[256]``) or of every anchor value (``[2^anchor_bits]``), by the reference."""
    if anchor_only:
        return reference.expanded_levels(torch.arange(1 << scheme.anchor_bits, dtype=torch.uint8), None, scheme).numpy()
    a, r = reference.split_code(torch.arange(256, dtype=torch.int32).to(torch.uint8), scheme)
    return reference.expanded_levels(a, r, scheme).numpy()



@functools.lru_cache(maxsize=32)
def approximation(scheme: Scheme) -> tuple[np.float32, np.float32, np.float32, np.float32, np.float32]:
    """``(α, 1/c, gk, gb, margin)`` of the kernels' first pass, fp32: ``g = (z + 1)·gk + gb`` puts the code
    boundaries at the integers (nested grid: ``gk = A·R/2``, ``gb = R/2``; uniform: ``Q/2``, ``1/2``).

    ``margin`` bounds how far that approximate ``g`` can be from the one the reference's ``z`` gives, times
    two: ``u`` by a reciprocal (2^-22 relative), ``α``, ``α|u|`` and ``1 + α|u|`` (2^-24 each), the log
    (:data:`LOG_ERROR`·max(1, c) absolute), the product by 1/c (2^-23), the reference's own rounding of z (2^-24), and
    2^-13 for the few fp32 roundings on the way to ``g`` in both (together about 2^-14). A margin past 1/4 (α so small
    that log(1 + α|u|) is mostly rounding) leaves every element to the exact pass.
    """
    if scheme.grid == "uniform":
        gk, gb = scheme.code_steps / 2.0, 0.5
    else:
        gk, gb = scheme.anchor_steps * scheme.residual_levels / 2.0, scheme.residual_levels / 2.0
    if scheme.compander == "linear":
        alpha, inv_c, eps_z = 0.0, 0.0, 2.0**-22 + 2.0**-24
    else:
        alpha = scheme.alpha
        c = float(np.float32(np.log1p(alpha)))
        inv_c = 1.0 / c
        eps_z = (1.75 * 2.0**-22 + LOG_ERROR * max(1.0, c)) / c + 2.0**-23 + 2.0**-24
    margin = 2.0 * (gk * eps_z + 2.0**-13)
    if margin > 0.25:
        margin = 2.0  # every |g - rint(g)| <= 1/2 is below it: the exact pass takes all
    f = np.float32
    return f(alpha), f(inv_c), f(gk), f(gb), f(margin)

