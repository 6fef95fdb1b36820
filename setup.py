"""The one compiled part of lynxkv: the CPU decode kernel (``lynxkv/quant/_native.c``, loaded with ctypes).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is found the install goes
on and lynxkv decodes with its numba kernel (``lynxkv.quant.fast``), which gives the same bits."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lynxkv.quant._native",
            sources=["lynxkv/quant/_native.c"],
            # -ffp-contract=off: no fused multiply-add, so o + s*level rounds twice, as the reference does.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
            optional=True,
        )
    ]
)
