"""CRC-32 of the format's headers, indexes and pages: the compiled carry-less-multiplication checksum
(``lynxkv/format/_crc.c``, a cffi module typed by ``_crc.h``) where it is built, else zlib's (the same value)."""

from __future__ import annotations

import zlib

from lynxkv.compiled import load_module

#: ``(ffi, lib)`` of ``lynxkv/format/_crc.c``, or None: then ``zlib.crc32`` (the same value) checks every page.
_FFI, _CRC = load_module("lynxkv.format._crc") or (None, None)
#: Below this many bytes zlib's own call is quicker than the compiled one.
_CRC_NATIVE_FROM = 1 << 13


def crc32(data) -> int:
    """CRC-32 as in zlib/PNG/gzip (``zlib.crc32``), of any bytes-like object: by carry-less multiplication where
    the compiled checksum is built and the CPU has it (a page in a few GB/s), else by zlib."""
    if _CRC is not None and len(data) >= _CRC_NATIVE_FROM:
        view = _FFI.from_buffer("uint8_t[]", data)
        return _CRC.lynx_crc32(view, len(view), 0)
    return zlib.crc32(data) & 0xFFFFFFFF
