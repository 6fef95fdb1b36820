"""Byte sources: what the format's page reader reads from (bytes, a memory-mapped file, a file object, any URL)."""

from __future__ import annotations

import io
import mmap
import os
import threading
from typing import Protocol

from lynxkv.errors import InputError, LynxError
from lynxkv.storage.urls import as_lynx_error, filesystem, has_protocol, is_local, local_path, refuse_nul


class ByteSource(Protocol):
    """What the format's page reader reads from: ``size`` bytes, random access. ``name`` says where it is (a
    path or URL; ``<bytes>``-style names for data without a place)."""

    name: str
    size: int

    def read(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


class BytesSource:
    """Bytes already in memory."""

    def __init__(self, data, name: str = "<bytes>"):
        self._data = memoryview(data).cast("B")
        self.size = len(self._data)
        self.name = name

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._data[offset:offset + length])

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes in place, without a copy."""
        return self._data[offset:offset + length]

    def close(self) -> None:
        pass


class FileSource:
    """A local file, memory-mapped: reading one page touches only that page's bytes."""

    def __init__(self, path: str | os.PathLike):
        import stat

        self.name = os.fspath(path)
        refuse_nul(self.name)  # os.open would raise a bare ValueError ("embedded null byte")
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
            fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise as_lynx_error(self.name, exc) from None
        try:  # what the descriptor is, before a file object owns it (os.fdopen of a directory raises, fd left open)
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise InputError(f"{self.name} is a directory, not a cache file")
            if not stat.S_ISREG(st.st_mode):
                raise InputError(f"{self.name} is not a regular file; refusing to read it")
            self._f = os.fdopen(fd, "rb")
        except BaseException as exc:
            try:
                os.close(fd)
            except OSError:  # already closed by a failed fdopen
                pass
            if isinstance(exc, OSError):
                raise InputError(f"{self.name}: cannot open the file ({exc.strerror or exc})") from None
            raise
        try:
            self.size = st.st_size
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except InputError:
            self._f.close()
            raise
        except (OSError, ValueError) as exc:
            self._f.close()
            raise InputError(f"{self.name}: cannot map the file ({exc})") from None

    def read(self, offset: int, length: int) -> bytes:
        mm = self._mm  # once: close() may run on another thread
        if mm is None:
            return b""
        return mm[offset:offset + length]

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)`` (clipped to the file) in place, without a copy: what a whole
        layer's load reads (the mapping stays valid while a view is held, even past :meth:`close`)."""
        mm = self._mm
        if mm is None:
            return memoryview(b"")
        return memoryview(mm)[offset:offset + length]

    def drop(self, offset: int, length: int) -> None:
        """The bytes ``[offset, offset + length)`` are not needed for now: the whole memory pages inside the range
        leave this process's resident memory (``madvise(MADV_DONTNEED)``). The mapping stays valid: a later read
        of them faults them back in from the page cache, unchanged. A reader that walks a file once calls this
        behind itself, so that the file's mapped pages do not add up to the whole file in its RSS."""
        mm = self._mm
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if mm is None or advice is None:
            return
        start = -(-max(offset, 0) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: a neighbour may be in use
        end = min(offset + length, self.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            try:
                mm.madvise(advice, start, end - start)
            except (OSError, ValueError):  # closed on another thread meanwhile: nothing left to drop
                pass

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still held: the mapping goes with the last one
                pass
            self._mm = None
        self._f.close()


class FileObjSource:
    """A seekable binary file object (e.g. an fsspec file doing HTTP/S3 range requests)."""

    def __init__(self, f, name: str = "<file>", size: int | None = None, *, owns: bool = False):
        self._f = f
        self._owns = owns  # close the file object on close() only if this source opened it
        self.name = name
        self._lock = threading.Lock()
        if size is None:
            size = f.seek(0, io.SEEK_END)
        self.size = int(size)

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            try:
                self._f.seek(offset)
                return self._f.read(max(0, min(length, self.size - offset)))
            except LynxError:
                raise
            except Exception as exc:  # noqa: BLE001 - a network file object fails in its own ways
                raise as_lynx_error(self.name, exc) from None

    def close(self) -> None:
        if self._owns:
            self._f.close()


def open_source(obj, name: str | None = None, storage_options: dict | None = None) -> ByteSource:
    """A byte source for a path or URL, a bytes-like object, a seekable file object, or a source itself."""
    if isinstance(obj, (str, os.PathLike)):
        text = os.fspath(obj)
        if has_protocol(text) and not is_local(text):
            fs, path = filesystem(text, storage_options)
            try:
                f = fs.open(path, "rb")
            except Exception as exc:  # noqa: BLE001 - fsspec raises backend-specific errors
                raise as_lynx_error(text, exc) from None
            try:
                return FileObjSource(f, text, size=getattr(f, "size", None), owns=True)
            except Exception as exc:  # noqa: BLE001
                f.close()
                raise as_lynx_error(text, exc) from None
        return FileSource(local_path(text))
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return BytesSource(obj, name or "<bytes>")
    if hasattr(obj, "size") and hasattr(obj, "read") and not hasattr(obj, "seek"):
        return obj
    if hasattr(obj, "seek") and hasattr(obj, "read"):
        return FileObjSource(obj, name or f"<{getattr(obj, 'name', 'file')}>")
    raise InputError(f"cannot read a .lynx cache from a {type(obj).__name__}")
