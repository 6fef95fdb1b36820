"""Triton kernels for the lynxkv quantizer, shipped as ``lynxkv.kernels``.

- :mod:`lynxkv.kernels.encode`: fused ``[B, H, T, D]`` -> chunk metadata + packed 4+4 codes (or unpacked
  anchor/residual bytes), bit-identical to :func:`lynxkv.quant.quantize` + :func:`lynxkv.quant.pack_bits`.
- :mod:`lynxkv.kernels.decode`: fused packed codes + metadata -> KV written in place in the HF layout.

Triton is an optional dependency (``pip install lynxkv[triton]``); import these modules only when it is there.
On a CPU they run under ``TRITON_INTERPRET=1`` (set before the first import), which is how the tests run them.
"""
