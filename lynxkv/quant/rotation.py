"""The per-head Walsh–Hadamard rotation of the keys (``Scheme.key_rotation = "hadamard"``): the one
place that defines it; the reference, the fast CPU path and Triton all use (or mirror) this arithmetic.

The keys are rotated along ``head_dim`` before they are quantized, and rotated back after they are decoded. An
orthonormal rotation spreads an outlier channel over its block, so the per-channel groups along tokens see
flatter ranges. The arithmetic is exact and fixed (spec/FORMAT.md §9.2, §9.3), so every implementation is bit
for bit the same:

- A key row ``x`` is the ``D`` channels of one token of one head, in fp32 (a bf16/fp16 input is widened
  exactly first). The block size is ``b = D & -D``, the largest power of two dividing ``D`` (``b = D`` for 64
  and 128; ``b = 1`` is the identity); ``m = log2(b)``, ``k = floor(m / 2)``.
- :func:`butterfly`: within each block of ``b`` consecutive channels, the unnormalised Walsh–Hadamard
  butterfly, stages ``h = 1, 2, 4, …, b/2`` in that order: for each pair ``(i, i+h)`` with ``i mod 2h < h``,
  ``(x_i, x_{i+h}) ← (x_i + x_{i+h}, x_i − x_{i+h})``, each an exactly rounded fp32 addition or subtraction.
  Applied twice it multiplies by ``b`` (up to rounding).
- Encode (:func:`rotate`): ``y = butterfly(x) · 2^−k``, then the key encoding of ``y``. A non-finite ``y`` (a
  finite row whose sums overflow fp32) is an encode error, like a non-finite input.
- Decode (:func:`unrotate`): ``x̂ = butterfly(ŷ) · 2^−(m−k)`` on the fp32 decoded ``ŷ``, before any cast to
  the requested dtype. The scalings by powers of two are exact (unless a result is subnormal, where they round
  once, to nearest even, as every IEEE implementation does).

Values are never rotated.
"""

from __future__ import annotations

import torch

from lynxkv.errors import InputError


def block_size(head_dim: int) -> int:
    """``b``: the largest power of two that divides ``head_dim`` (1 for an odd head_dim: the identity)."""
    return head_dim & -head_dim if head_dim > 0 else 1


def shifts(head_dim: int) -> tuple[int, int]:
    """``(k, m - k)``: the power-of-two exponents of the encode and decode scalings (``2^-k``, ``2^-(m-k)``)."""
    m = block_size(head_dim).bit_length() - 1
    return m // 2, m - m // 2


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh–Hadamard butterfly of every row of ``x`` ``[..., D]`` (fp32) within blocks of
    :func:`block_size` channels, in the fixed stage order of the module docstring (a new tensor)."""
    d = x.shape[-1]
    b = block_size(d)
    lead = x.shape[:-1]
    h = 1
    while h < b:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)  # groups of 2h channels never cross a block (2h <= b, b | D)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((first + second, first - second), dim=-2).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``butterfly(x) · 2^-k`` in fp32 (``x`` any float dtype, ``[..., D]``): the rotated keys that are encoded."""
    k, _ = shifts(x.shape[-1])
    y = butterfly(x.float())
    return y * (2.0**-k) if k else y


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """``butterfly(ŷ) · 2^-(m-k)`` in fp32: the decoded rotated keys ``ŷ`` ``[..., D]`` back in the original
    domain (the inverse of :func:`rotate` up to rounding)."""
    _, back = shifts(y.shape[-1])
    x = butterfly(y.float())
    return x * (2.0**-back) if back else x


def overflow_error() -> InputError:
    """The encode error for finite keys whose rotation overflows fp32."""
    return InputError("keys overflow fp32 when rotated (the Hadamard key rotation sums up to head_dim values); "
                      "quantize such keys with key_rotation=\"none\"")
