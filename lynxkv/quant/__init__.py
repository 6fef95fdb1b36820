"""The quantizer. Callers use this entry (:mod:`lynxkv.quant.dispatch`: the torch reference, the fast CPU path
or Triton, chosen by device and scheme, all bit-identical); :mod:`lynxkv.quant.reference` is the normative
arithmetic and the tests' oracle."""

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
