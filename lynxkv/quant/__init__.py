"""The quantizer: the normative torch reference (:mod:`lynxkv.quant.reference`) and bit packing."""

from lynxkv.quant.pack import pack_bits, unpack_bits
from lynxkv.quant.reference import (
    META_TORCH_DTYPE,
    EncodedTensor,
    dequantize,
    error_bound,
    join_code,
    quantize,
    split_code,
)

__all__ = [
    "META_TORCH_DTYPE",
    "EncodedTensor",
    "dequantize",
    "error_bound",
    "join_code",
    "pack_bits",
    "quantize",
    "split_code",
    "unpack_bits",
]
