"""Bit packing of codes: an LSB-first bit stream over the elements in order (spec/FORMAT.md, "Packing").

Element i occupies bits ``[i·b, (i+1)·b)`` of the stream, bit j of the stream being bit ``j mod 8`` of byte
``j // 8``. For b = 4 this is two values per byte, the first in the low nibble. The stream is padded with
zero bits to a whole byte.
"""

from __future__ import annotations

import numpy as np
import torch

from lynxkv.errors import FormatError


def packed_size(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``values`` (uint8, each < 2**bits) into a uint8 tensor of ``packed_size(numel, bits)`` bytes."""
    flat = values.reshape(-1).to(torch.uint8)
    n = flat.numel()
    if bits == 8:
        return flat.clone()
    if bits == 4:
        if n % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        pairs = flat.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    arr = flat.numpy()
    bitplanes = np.unpackbits(arr[:, None], axis=1, bitorder="little")[:, :bits]
    packed = np.packbits(bitplanes.reshape(-1), bitorder="little")
    return torch.from_numpy(packed)


def unpack_bits(packed: torch.Tensor | bytes | memoryview, bits: int, count: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: ``count`` uint8 values of ``bits`` bits each."""
    if not isinstance(packed, torch.Tensor):
        packed = torch.frombuffer(bytearray(packed), dtype=torch.uint8) if len(packed) else torch.empty(0, dtype=torch.uint8)
    need = packed_size(count, bits)
    if packed.numel() != need:
        raise FormatError(f"packed payload: expected {need} bytes for {count} {bits}-bit values, got {packed.numel()}")
    if bits == 8:
        return packed.clone()
    if bits == 4:
        out = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)
        return out[:count].contiguous()
    planes = np.unpackbits(packed.numpy(), bitorder="little")[: count * bits].reshape(count, bits)
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    return torch.from_numpy((planes.astype(np.uint16) @ weights).astype(np.uint8))
