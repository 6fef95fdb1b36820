"""Triton kernels for the lynxkv quantizer, shipped as ``lynxkv.kernels``."""
