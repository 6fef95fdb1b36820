"""CRC-32 of the format's headers, indexes and pages: the compiled carry-less-multiplication checksum
(``lynxkv/format/_crc.c``) where it is built, else zlib's (the same value)."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

from lynxkv.compiled import load_extension

#: ``lynx_crc32`` of ``lynxkv/format/_crc.c``, or None: then ``zlib.crc32`` (the same value) checks every page.
_CRC = load_extension("lynxkv.format._crc",
                      {"lynx_crc32": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32], ctypes.c_uint32)})
#: Below this many bytes zlib's own call is quicker than the ctypes call.
_CRC_NATIVE_FROM = 1 << 14


def crc32(data) -> int:
    """CRC-32 as in zlib/PNG/gzip (``zlib.crc32``), of any bytes-like object: by carry-less multiplication where
    the compiled checksum is built and the CPU has it (a page in a few GB/s), else by zlib."""
    if _CRC is not None and len(data) >= _CRC_NATIVE_FROM:
        view = np.frombuffer(data, dtype=np.uint8)
        return _CRC.lynx_crc32(view.ctypes.data, view.size, 0)
    return zlib.crc32(data) & 0xFFFFFFFF
