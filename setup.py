"""The compiled parts of lynxkv, all loaded with ctypes: the CPU quantizer kernels (``lynxkv/quant/_native.c``),
the exact remainder's byte planes (``lynxkv/quant/_remainder.c``) and the page checksum (``lynxkv/format/_crc.c``).

Everything else is in pyproject.toml. The extensions are optional: where no C compiler is found the install
goes on, and lynxkv quantizes with the torch reference (``lynxkv.quant.reference``, the same bits, much slower)
and checksums with ``zlib.crc32``."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lynxkv.quant._native",
            sources=["lynxkv/quant/_native.c"],
            # -ffp-contract=off: no fused multiply-add, so o + s*level rounds twice, as the reference does.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
            optional=True,
        ),
        Extension("lynxkv.quant._remainder", sources=["lynxkv/quant/_remainder.c"],
                  extra_compile_args=["-O3", "-Wall"], optional=True),
        Extension("lynxkv.format._crc", sources=["lynxkv/format/_crc.c"], extra_compile_args=["-O3", "-Wall"],
                  optional=True),
    ]
)
