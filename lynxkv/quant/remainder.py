"""The exact remainder: the original bf16/fp16/fp32 values, bit for bit, from the full code's decoding.

Each value's bits are mapped to an integer that orders like the value (negative values with their magnitude bits
flipped: ``o = s ^ ((s >> (w-1)) & (2^(w-1) - 1))`` on the signed ``w``-bit view ``s``, an involution), and the
remainder is the difference ``o(original) - o(predicted)`` modulo ``2^w``, where ``predicted`` is the full code
decoded to the original dtype (spec §9.3). The difference is zigzagged (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...), the
elements are put in the order of the prediction's exponent field (stable: ties keep their order), and the result
is split into byte planes (plane ``j`` holds byte ``j`` of every element, little-endian). Near the prediction the
difference is a few ULPs, and how many depends on the value's exponent: in that order the values whose
remainders look alike sit together, and the nearly empty high planes and the noisy low plane each compress on
their own (spec/FORMAT.md §10).

Two paths give the same bytes: the compiled one (``lynxkv/quant/_remainder.c``, a counting sort and one pass,
GB/s) where it is built, and the torch reference below (``LYNXKV_NATIVE=0``, or no C compiler at install).
"""

from __future__ import annotations

import torch

from lynxkv.compiled import load_module
from lynxkv.errors import InputError

#: the dtypes an exact remainder is defined for, by the names the format uses
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: dtype -> (the signed integer view of its bits, its width in bits)
_VIEWS = {torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16), torch.float32: (torch.int32, 32)}
#: dtype -> (shift, mask) of its exponent field, the key of the element order
_EXPONENT = {torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F), torch.float32: (23, 0xFF)}

#: ``lynxkv/quant/_remainder.c`` (a cffi module typed by ``_remainder.h``), or None (not built, or
#: ``LYNXKV_NATIVE=0``): the reference runs.
_FFI, _LIB = load_module("lynxkv.quant._remainder") or (None, None)


def compiled() -> bool:
    """True when the compiled remainder runs (else the torch reference: the same bytes, slower)."""
    return _LIB is not None


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


def element_order(predicted: torch.Tensor) -> torch.Tensor:
    """The order of the elements in the planes: indices of ``predicted`` (flattened) stably sorted by the exponent
    field of its values' bits (bf16 and fp32: bits 7-14 and 23-30 of the element, fp16: bits 10-14)."""
    shift, mask = _EXPONENT[predicted.dtype]
    bits, _ = _wide(predicted)
    return torch.argsort((bits.reshape(-1) >> shift) & mask, stable=True)


def group_sizes(predicted: torch.Tensor) -> list[int]:
    """How many elements of each exponent value :func:`element_order` puts together, in that order (the nonzero
    counts only): where the runs of alike remainders start and end in each plane."""
    shift, mask = _EXPONENT[predicted.dtype]
    bits, _ = _wide(predicted)
    counts = torch.bincount(((bits.reshape(-1) >> shift) & mask), minlength=mask + 1)
    return counts[counts > 0].tolist()


def _check(original: torch.Tensor, predicted: torch.Tensor) -> None:
    _width(predicted.dtype)
    if original.dtype != predicted.dtype or original.shape != predicted.shape:
        raise InputError(f"exact remainder: original {tuple(original.shape)} {original.dtype} and prediction "
                         f"{tuple(predicted.shape)} {predicted.dtype} differ")


def remainder_planes(original: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """uint8 ``[element_bytes, N]``: the zigzagged ordered difference of ``original`` against ``predicted`` (same
    dtype and shape, flattened row-major) in the prediction's exponent order, one byte plane per row."""
    return remainder_planes_and_runs(original, predicted)[0]


def remainder_planes_and_runs(original: torch.Tensor, predicted: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """:func:`remainder_planes` and :func:`group_sizes` of ``predicted`` together (one pass where compiled)."""
    _check(original, predicted)
    if _LIB is not None and original.device.type == "cpu" and predicted.device.type == "cpu":
        x, p = original.contiguous().reshape(-1), predicted.contiguous().reshape(-1)
        e = element_bytes(x.dtype)
        out = torch.empty(e, x.numel(), dtype=torch.uint8)
        counts = torch.empty(256, dtype=torch.int64)
        _native_call(_LIB.lynx_exact_planes(_FFI.cast("void *", x.data_ptr()), _FFI.cast("void *", p.data_ptr()),
                                            x.numel(), e, x.dtype == torch.float16,
                                            _FFI.cast("uint8_t *", out.data_ptr()),
                                            _FFI.cast("int64_t *", counts.data_ptr())))
        return out, counts[counts > 0].tolist()
    return reference_planes(original, predicted), group_sizes(predicted)


def apply_planes(planes: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """The original values from their byte planes (:func:`remainder_planes`) and the same prediction."""
    w = _width(predicted.dtype)
    n = predicted.numel()
    if tuple(planes.shape) != (w // 8, n):
        raise InputError(f"exact remainder: expected planes [{w // 8}, {n}], got {tuple(planes.shape)}")
    if _LIB is not None and planes.device.type == "cpu" and predicted.device.type == "cpu":
        planes, p = planes.contiguous(), predicted.contiguous()
        out = torch.empty_like(p)
        _native_call(_LIB.lynx_exact_apply(_FFI.cast("uint8_t *", planes.data_ptr()), _FFI.cast("void *", p.data_ptr()),
                                           n, w // 8, p.dtype == torch.float16, _FFI.cast("void *", out.data_ptr())))
        return out
    return reference_apply(planes, predicted)


def _native_call(status: int) -> None:
    if status == -2:
        raise MemoryError("exact remainder: the scratch memory could not be allocated")
    if status:  # pragma: no cover - the widths are checked above
        raise InputError(f"exact remainder: the compiled remainder refused the call ({status})")


def reference_planes(original: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """:func:`remainder_planes` in torch: the normative arithmetic."""
    _check(original, predicted)
    o, w = _wide(original)
    p, _ = _wide(predicted)
    full = (1 << w) - 1
    d = (_ordered(o, w) - _ordered(p, w)) & full  # modulo 2^w
    d = torch.where(d >= (1 << (w - 1)), d - (1 << w), d)  # the signed w-bit difference
    z = ((d << 1) ^ (d >> (w - 1))) & full  # zigzag
    z = z.reshape(-1)[element_order(predicted)]
    return torch.stack([((z >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(w // 8)])


def reference_apply(planes: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """:func:`apply_planes` in torch: the normative arithmetic."""
    w = _width(predicted.dtype)
    wide = torch.int32 if w == 16 else torch.int64
    z_sorted = planes[0].to(wide)
    for j in range(1, w // 8):
        z_sorted |= planes[j].to(wide) << (8 * j)
    z = torch.empty_like(z_sorted)
    z[element_order(predicted)] = z_sorted
    d = (z >> 1) ^ -(z & 1)  # zigzag undone: the signed difference
    p, _ = _wide(predicted)
    full = (1 << w) - 1
    o = (_ordered(p.reshape(-1), w) + d) & full
    o = torch.where(o >= (1 << (w - 1)), o - (1 << w), o)
    bits = _ordered(o, w).to(_VIEWS[predicted.dtype][0])
    return bits.view(predicted.dtype).view(predicted.shape)

