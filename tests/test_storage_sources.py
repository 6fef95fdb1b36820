"""Byte sources: a layer's records read in place (views of a file's mapping or of bytes given) are the bytes a
copy gives, and a source closes while a view of it is still held."""

from __future__ import annotations

import os

from lynxkv.storage import open_source


def test_views_are_the_bytes_and_outlive_close(tmp_path):
    data = os.urandom(100_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    for src in (open_source(str(path)), open_source(data)):
        view = src.view(12_345, 50_000)
        assert bytes(view) == src.read(12_345, 50_000) == data[12_345:62_345]
        assert bytes(src.view(99_990, 100)) == data[99_990:]  # clipped to the end, as read() is
        src.close()  # a view is still held: no BufferError
        assert bytes(view[:10]) == data[12_345:12_355]  # and it still reads the mapped bytes
        view.release()


def test_adjacent_views_join_without_a_copy(tmp_path):
    """join_records: records lying back to back in one mapping become one view of it (what an in-place
    progressive load hands the dequantization); anything else is joined by a copy. Same bytes, same offsets."""
    import numpy as np

    from lynxkv.format.records import join_records

    data = os.urandom(10_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    src = open_source(str(path))
    spans = [(100, 300), (400, 1000), (1400, 8)]
    other = open_source(data)
    cases = {
        "adjacent views of the mapping": ([src.view(a, n) for a, n in spans], True),
        "a gap between two views": ([src.view(100, 300), src.view(401, 999)], False),
        "views of two objects": ([src.view(100, 300), other.view(400, 1000)], False),
        "out of order": ([src.view(400, 1000), src.view(100, 300)], False),
        "bytes": ([data[a:a + n] for a, n in spans], False),
    }
    for name, (raws, shared) in cases.items():
        joined, at = join_records(raws)
        assert bytes(joined) == b"".join(bytes(r) for r in raws), name
        assert at == [sum(len(r) for r in raws[:i]) for i in range(len(raws))], name
        first = np.frombuffer(raws[0], np.uint8)
        assert np.shares_memory(np.frombuffer(joined, np.uint8), first) == shared, name
    src.close()
    other.close()


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_dropped_pages_leave_the_rss_and_read_back_unchanged(tmp_path):
    """FileSource.drop: a mapped file's pages read once leave the process's RSS (what keeps a whole-cache load
    at its output's size), and reading them again gives the same bytes."""
    import mmap
    import zlib

    import pytest

    if not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/status"):
        pytest.skip("needs madvise(MADV_DONTNEED) and /proc (Linux)")
    data = os.urandom(16 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    src = open_source(str(path))
    view = src.view(0, len(data))
    before = _rss_file()
    assert zlib.crc32(view) == zlib.crc32(data)  # every page of the mapping read in place
    read = _rss_file()
    src.drop(100, len(data) - 200)  # all but the two partial pages at the ends
    dropped = _rss_file()
    assert read - before > 12 << 20 and read - dropped > 12 << 20, (before, read, dropped)
    assert zlib.crc32(view) == zlib.crc32(data)  # faulted back in, unchanged
    src.drop(0, 1 << 40)  # past the end: clipped
    assert bytes(src.view(len(data) - 10, 10)) == data[-10:]
    view.release()
    src.close()
    src.drop(0, 10)  # closed: nothing to drop, no error
