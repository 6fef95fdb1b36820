"""The compiled extensions (``lynxkv/quant/_native.c``, ``lynxkv/format/_crc.c``, built by ``pip install``),
loaded with ctypes: their calls release the GIL. Either may be missing (no C compiler at install) or turned off
with ``LYNXKV_NATIVE=0``; their users then take their pure-Python paths, which give the same results."""

from __future__ import annotations

import ctypes
import importlib.util
import os


def load_extension(module: str, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """The shared library of extension ``module`` (e.g. ``"lynxkv.format._crc"``) with each function of
    ``signatures`` (name -> (argtypes, restype)) declared, or None where it was not built, does not load, or
    ``LYNXKV_NATIVE=0``."""
    if os.environ.get("LYNXKV_NATIVE", "1") == "0":
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:  # pragma: no cover - a broken build; the pure-Python path stays in charge
        return None
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib
