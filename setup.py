"""The compiled parts of lynxkv, each a cffi module (API mode) typed by its header: the CPU quantizer kernels
(``lynxkv/quant/_native.c``, ``_native.h``), the exact remainder (``lynxkv/quant/_remainder.c``, ``_remainder.h``) and the page checksum (``lynxkv/format/_crc.c``,
``_crc.h``).

The header is the one statement of each binding: the C file includes it, so a definition that disagrees does not
compile, and cffi generates the module's wrappers from the same declarations, so Python calls go through the C
types (a wrong argument raises TypeError or OverflowError in Python). Everything else is in pyproject.toml.

The extensions are optional: where no C compiler is found (or cffi is missing) the install goes on, and lynxkv
quantizes with the torch reference (``lynxkv.quant.reference``: the same bits, much slower) and checksums with
``zlib.crc32``. Run as a build script only; cffi reads it again (``__name__ == "__cffi__"``) for the modules."""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
# -ffp-contract=off: no fused multiply-add, so o + s*level rounds twice, as the reference does.
NATIVE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall"]


def _ffi(module: str, header: str, sources: list[str], flags: list[str]):
    """The cffi builder of extension ``module``: the declarations of ``header`` (its ``#`` lines dropped, which
    cffi's parser does not take), the wrappers compiled with ``sources`` and the header itself included."""
    from cffi import FFI

    lines = (HERE / header).read_text(encoding="utf-8").splitlines()
    ffi = FFI()
    ffi.cdef("\n".join(line for line in lines if not line.lstrip().startswith("#")))
    # depends: the header goes into the sdist (and a change to it rebuilds the module)
    ffi.set_source(module, f'#include "{Path(header).name}"', sources=sources, include_dirs=[str(Path(header).parent)],
                   depends=[header], extra_compile_args=flags, optional=True, py_limited_api=False)
    return ffi


def native_ffi():
    return _ffi("lynxkv.quant._native", "lynxkv/quant/_native.h", ["lynxkv/quant/_native.c"], NATIVE_FLAGS)


def remainder_ffi():
    return _ffi("lynxkv.quant._remainder", "lynxkv/quant/_remainder.h", ["lynxkv/quant/_remainder.c"],
                ["-O3", "-Wall"])


def crc_ffi():
    return _ffi("lynxkv.format._crc", "lynxkv/format/_crc.h", ["lynxkv/format/_crc.c"], ["-O3", "-Wall"])


def _cffi_modules() -> list[str]:
    try:
        import cffi  # noqa: F401
    except ImportError:  # no extensions: the pure-Python paths run
        print("lynxkv: cffi is not installed; building without the compiled kernels")
        return []
    return [f"setup.py:{name}" for name in ("native_ffi", "remainder_ffi", "crc_ffi")]


if __name__ == "__main__":
    setup(cffi_modules=_cffi_modules())
