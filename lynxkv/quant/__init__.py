"""The quantizer: tensors <-> 8-bit codes split into anchor and residual (reference, fast CPU, Triton: same bits)."""

from lynxkv.quant.dispatch import (dequantize, dequantize_packed, dequantize_pages, pack_bits, quantize, quantize_packed,
                                   unpack_bits)
from lynxkv.quant.reference import META_TORCH_DTYPE, EncodedTensor, error_bound, join_code, split_code

__all__ = [
    "META_TORCH_DTYPE",
    "EncodedTensor",
    "dequantize",
    "dequantize_packed",
    "dequantize_pages",
    "error_bound",
    "join_code",
    "pack_bits",
    "quantize",
    "quantize_packed",
    "split_code",
    "unpack_bits",
]
