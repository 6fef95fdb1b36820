"""The exact remainder (format 1.4): the original bf16/fp16/fp32 values, bit for bit, from the full code's decoding.

Each value's bits are mapped to an integer that orders like the value (negative values with their magnitude bits
flipped: ``o = s ^ ((s >> (w-1)) & (2^(w-1) - 1))`` on the signed ``w``-bit view ``s``, an involution), and the
remainder is the difference ``o(original) - o(predicted)`` modulo ``2^w``, where ``predicted`` is the full code
decoded to the original dtype (spec §9.3). The difference is zigzagged (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...) and
split into byte planes (plane ``j`` holds byte ``j`` of every element, little-endian), so that the nearly empty
high planes and the noisy low plane each compress on their own. Near the prediction the difference is a few ULPs,
so the low plane carries almost all of it. Pure torch; the format stores the planes (spec/FORMAT.md §12).
"""

from __future__ import annotations

import torch

from lynxkv.errors import InputError

#: the dtypes an exact remainder is defined for, by the names the format uses
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: dtype -> (the signed integer view of its bits, its width in bits)
_VIEWS = {torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16), torch.float32: (torch.int32, 32)}


def element_bytes(dtype: torch.dtype) -> int:
    return _width(dtype) // 8


def _width(dtype: torch.dtype) -> int:
    if dtype not in _VIEWS:
        raise InputError(f"exact remainder: dtype {dtype} is not one of bf16, fp16, fp32")
    return _VIEWS[dtype][1]


def _ordered(bits: torch.Tensor, w: int) -> torch.Tensor:
    """The order-preserving integer of signed ``w``-bit float bits (widened): its own inverse."""
    return bits ^ ((bits >> (w - 1)) & ((1 << (w - 1)) - 1))


def _wide(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    view, w = _VIEWS[x.dtype]
    return x.contiguous().view(view).to(torch.int32 if w == 16 else torch.int64), w


def remainder_planes(original: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """uint8 ``[element_bytes, N]``: the zigzagged ordered difference of ``original`` against ``predicted`` (same
    dtype and shape, flattened row-major), one byte plane per row."""
    if original.dtype != predicted.dtype or original.shape != predicted.shape:
        raise InputError(f"exact remainder: original {tuple(original.shape)} {original.dtype} and prediction "
                         f"{tuple(predicted.shape)} {predicted.dtype} differ")
    o, w = _wide(original)
    p, _ = _wide(predicted)
    full = (1 << w) - 1
    d = (_ordered(o, w) - _ordered(p, w)) & full  # modulo 2^w
    d = torch.where(d >= (1 << (w - 1)), d - (1 << w), d)  # the signed w-bit difference
    z = ((d << 1) ^ (d >> (w - 1))) & full  # zigzag
    z = z.reshape(-1)
    return torch.stack([((z >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(w // 8)])


def apply_planes(planes: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """The original values from their byte planes (``remainder_planes``) and the same prediction."""
    w = _width(predicted.dtype)
    n = predicted.numel()
    if tuple(planes.shape) != (w // 8, n):
        raise InputError(f"exact remainder: expected planes [{w // 8}, {n}], got {tuple(planes.shape)}")
    wide = torch.int32 if w == 16 else torch.int64
    z = planes[0].to(wide)
    for j in range(1, w // 8):
        z |= planes[j].to(wide) << (8 * j)
    d = (z >> 1) ^ -(z & 1)  # zigzag undone: the signed difference
    p, _ = _wide(predicted)
    full = (1 << w) - 1
    o = (_ordered(p.reshape(-1), w) + d) & full
    o = torch.where(o >= (1 << (w - 1)), o - (1 << w), o)
    bits = _ordered(o, w).to(_VIEWS[predicted.dtype][0])
    return bits.view(predicted.dtype).view(predicted.shape)
