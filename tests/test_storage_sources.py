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
