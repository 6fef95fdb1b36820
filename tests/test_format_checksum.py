"""The page checksum: ``lynxkv.format.checksum.crc32`` is zlib's CRC-32 for every length, alignment and buffer type,
through the compiled carry-less path where it was built and through zlib."""

from __future__ import annotations

import mmap
import random
import zlib

import pytest

from lynxkv.format import checksum as crc_module


@pytest.fixture(params=["c", "zlib"])
def checksum(request, monkeypatch):
    if request.param == "c" and crc_module._CRC is None:
        pytest.skip("the compiled checksum was not built (no compiler at install)")
    if request.param == "zlib":
        monkeypatch.setattr(crc_module, "_CRC", None)
    monkeypatch.setattr(crc_module, "_CRC_NATIVE_FROM", 0)  # every length through the path under test
    return crc_module.crc32


def test_crc32_is_zlibs_for_every_length_and_alignment(checksum):
    rng = random.Random(7)
    data = rng.randbytes(4096 + 64)
    for n in list(range(0, 300)) + [1023, 1024, 1025, 4095, 4096]:
        for start in (0, 1, 7, 15, 33):
            chunk = data[start:start + n]
            assert checksum(chunk) == zlib.crc32(chunk), (n, start)
            assert checksum(memoryview(data)[start:start + n]) == zlib.crc32(chunk), (n, start)


def test_crc32_of_patterns_and_large_buffers(checksum, tmp_path):
    for pattern in (b"\x00", b"\xff", b"\x80\x01"):
        blob = pattern * 100_003
        assert checksum(blob) == zlib.crc32(blob)
    blob = random.Random(3).randbytes(5_000_011)
    assert checksum(bytearray(blob)) == zlib.crc32(blob)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            assert checksum(view[12345:]) == zlib.crc32(blob[12345:])  # a read-only mapping, in place
        finally:
            view.release()


def test_a_flipped_bit_changes_the_checksum(checksum):
    blob = bytearray(random.Random(5).randbytes(70_000))
    good = checksum(blob)
    for bit in (0, 8 * 64 + 3, 8 * 40_000 + 7, 8 * len(blob) - 1):
        blob[bit // 8] ^= 1 << (bit % 8)
        assert checksum(blob) != good
        blob[bit // 8] ^= 1 << (bit % 8)
