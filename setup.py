"""The compiled parts of lynxkv, both loaded with ctypes: the CPU decode kernel (``lynxkv/quant/_native.c``) and
the page checksum (``lynxkv/format/_crc.c``).

Everything else is in pyproject.toml. The extensions are optional: where no C compiler is found the install
goes on, and lynxkv decodes with its numba kernel (``lynxkv.quant.fast``) and checksums with ``zlib.crc32``,
which give the same results."""

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
        Extension("lynxkv.format._crc", sources=["lynxkv/format/_crc.c"], extra_compile_args=["-O3", "-Wall"],
                  optional=True),
    ]
)
