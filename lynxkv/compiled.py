"""The compiled extensions (``lynxkv/quant/_native.c``, ``_remainder.c``, ``lynxkv/format/_crc.c``, built by
``pip install`` as cffi modules whose C types come from a header next to each file; see setup.py). Their calls
release the GIL. Any may be missing (no C compiler at install) or turned off with ``LYNXKV_NATIVE=0``; their users
then take their pure-Python paths, which give the same results."""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings


def disabled() -> bool:
    """``LYNXKV_NATIVE=0``: every compiled path is off (the pure-Python ones run)."""
    return os.environ.get("LYNXKV_NATIVE", "1") == "0"


def load_module(module: str):
    """The ``(ffi, lib)`` of cffi extension ``module`` (e.g. ``"lynxkv.quant._native"``): ``lib`` calls its C
    functions with the header's types, ``ffi`` makes the pointers they take. None where it was not built, does
    not load, or ``LYNXKV_NATIVE=0``."""
    if disabled():
        return None
    try:
        ext = importlib.import_module(module)
    except ImportError:  # not built (no compiler at install), or cffi's backend is missing
        return None
    if not hasattr(ext, "ffi") or not hasattr(ext, "lib"):  # a library built before the cffi bindings
        warnings.warn(f"{module} at {getattr(ext, '__file__', '?')} is a stale build without its cffi binding: the "
                      "pure-Python path runs; rebuild it (pip install -e ., or python setup.py build_ext --inplace)",
                      RuntimeWarning, stacklevel=2)
        return None
    return ext.ffi, ext.lib
