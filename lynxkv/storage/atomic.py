"""Atomic writes: an object appears under its name complete or not at all (:class:`AtomicWriter`)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
from collections.abc import Iterator

from lynxkv.errors import InputError, LynxError
from lynxkv.storage.urls import as_lynx_error, filesystem, is_local, local_path, refuse_nul


_TMP_SUFFIX = ".tmp"
WRITEBACK_BYTES = 8 << 20  # a local file is synced to its disk in the background every this many bytes written


class _Flusher:
    """``fdatasync`` of a file being written, on a thread of its own, each time :meth:`kick` asks: the disk (and a
    virtual disk's cache behind it) takes the bytes while the writer produces more, so the fsync of the commit
    waits only for the last of them. An error is kept for the commit to raise (the kernel reports a writeback
    error once)."""

    def __init__(self, fd: int):
        self._fd, self._wanted, self._stop = fd, threading.Event(), False
        self._thread: threading.Thread | None = None
        self.error: OSError | None = None

    def kick(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lynxkv-fsync", daemon=True)
            self._thread.start()
        self._wanted.set()

    def close(self) -> None:
        """Stop, after the sync under way (the file may be closed then)."""
        if self._thread is not None:
            self._stop = True
            self._wanted.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stop:
                return
            try:
                sync(self._fd)
            except OSError as exc:
                self.error = exc
                return


def _temp_name(final: str) -> str:
    """``.NAME.<pid>-<random>.tmp`` beside ``final``: hidden, and naming the process that writes it."""
    d, base = os.path.split(final)
    return os.path.join(d, f".{base}.{os.getpid()}-{secrets.token_hex(4)}{_TMP_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


_TEMP_NAME = re.compile(r"^\.(?P<base>.+)\.(?P<pid>\d+)-[0-9a-f]{8}" + re.escape(_TMP_SUFFIX) + "$")


def clean_stale_temps(final: str, dead_pids=()) -> list[str]:
    """Remove the temporary files that a killed writer of ``final`` left behind: exactly the names
    ``.NAME.<pid>-<8 hex>.tmp`` that :class:`AtomicWriter` gives ``final``'s temporaries, whose process is gone
    (or is one of ``dead_pids``: a writer known to have died, its number since taken by another process)."""
    d, base = os.path.split(os.path.abspath(final))
    removed = []
    try:
        listing = os.listdir(d)
    except OSError:
        return removed
    for n in listing:
        m = _TEMP_NAME.match(n)
        if m is None or m["base"] != base:
            continue
        pid = int(m["pid"])
        if pid in dead_pids or not _pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, n))
                removed.append(n)
    return removed


def _fsync_dir(d: str) -> None:
    with contextlib.suppress(OSError):  # make the rename itself durable, where the platform allows it
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicWriter:
    """A streaming writer that publishes the object under its name only on :meth:`commit` (or a clean ``with``
    exit); :meth:`abort` (or an exception inside ``with``) leaves nothing under the real name.

    Local files: a temporary ``.NAME.<pid>-<random>.tmp`` in the same directory (temporaries of writers that were
    killed are removed first; ``make_dirs`` creates missing directories), fsync, ``os.replace``, directory fsync.
    The file gets the permissions the umask
    gives a new file, or those of the file it replaces. Object stores (s3, memory, ...): one PUT of the whole
    object on commit, so an aborted upload leaves nothing.
    """

    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None, *, make_dirs: bool = False):
        self.url = os.fspath(url)
        self._done = False
        self._f = None
        if is_local(self.url):
            refuse_nul(self.url)  # os.stat / os.open would raise a bare ValueError ("embedded null byte")
            path = os.path.abspath(local_path(self.url))
            if os.path.isdir(path) and not os.path.islink(path):  # os.replace would fail only at the commit
                raise InputError(f"{self.url} is a directory; cannot write a file in its place")
            d = os.path.dirname(path)
            if make_dirs:
                try:
                    os.makedirs(d, exist_ok=True)
                except OSError as exc:
                    raise InputError(f"{self.url}: cannot create directory {d} ({exc.strerror or exc})") from None
            if not os.path.isdir(d):
                raise InputError(f"{self.url}: directory {d} does not exist")
            clean_stale_temps(path)
            self._final = path
            self.temp_path = _temp_name(path)
            try:
                mode = os.stat(path).st_mode & 0o7777 if os.path.isfile(path) else None
                fd = os.open(self.temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
                if mode is not None:
                    os.chmod(self.temp_path, mode)
            except OSError as exc:
                raise as_lynx_error(self.url, exc) from None
            self._f = os.fdopen(fd, "wb")
            self._flusher = _Flusher(fd)
            self._parts = None
        else:
            self._fs, self._path = filesystem(self.url, storage_options)
            self.temp_path = None
            self._parts = []
        self._size = 0  # bytes written (or reserved) so far: the next write's offset
        self._flushed = 0  # local files: the bytes before this offset were written when the flusher was last asked
        self._reserved: dict[int, int] = {}  # object stores: offset of a reserve -> index of its part

    def write(self, data) -> None:
        """Append ``data`` (any bytes-like object; written as it is, not copied first). A local file is synced in
        the background every :data:`WRITEBACK_BYTES` (:class:`_Flusher`)."""
        if self._f is not None:
            try:
                self._f.write(data)
                self._size += memoryview(data).nbytes
                if self._size - self._flushed >= WRITEBACK_BYTES:
                    self._f.flush()
                    self._flusher.kick()
                    self._flushed = self._size
            except OSError as exc:
                self.abort()
                raise _storage_error(self.url, exc) from None
        else:
            self._parts.append(bytes(data))
            self._size += len(self._parts[-1])

    def reserve(self, n: int) -> int:
        """Leave ``n`` bytes at the current end for :meth:`fill` (a header written once what follows it is known);
        return their offset. A local file skips them (a hole until filled)."""
        at = self._size
        if self._f is not None:
            try:
                self._f.seek(at + n)
            except OSError as exc:
                self.abort()
                raise _storage_error(self.url, exc) from None
        else:
            self._reserved[at] = len(self._parts)
            self._parts.append(bytes(n))
        self._size += n
        return at

    def fill(self, offset: int, data) -> None:
        """Write the bytes of the :meth:`reserve` at ``offset`` (exactly its length)."""
        if self._f is not None:
            try:
                _pwrite_all(self._f, offset, data)
            except OSError as exc:
                self.abort()
                raise _storage_error(self.url, exc) from None
        else:
            i = self._reserved.pop(offset)
            if len(data) != len(self._parts[i]):
                raise ValueError(f"fill: {len(data)} bytes for a reserve of {len(self._parts[i])}")
            self._parts[i] = bytes(data)

    def commit(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            if self._f is not None:
                self._f.flush()
                self._flusher.close()
                if self._flusher.error is not None:
                    raise self._flusher.error
                os.fsync(self._f.fileno())
                self._f.close()
                os.replace(self.temp_path, self._final)
                _fsync_dir(os.path.dirname(self._final))
            else:
                self._fs.pipe_file(self._path, b"".join(self._parts))
                self._parts = []
                self._fs.invalidate_cache(self._path)
        except BaseException as exc:
            self._discard()
            if isinstance(exc, Exception) and not isinstance(exc, LynxError):
                raise _storage_error(self.url, exc) from None
            raise

    def abort(self) -> None:
        self._done = True
        self._discard()

    def _discard(self) -> None:
        if self._f is not None:
            self._flusher.close()  # before the file is closed: its descriptor may be reused
            with contextlib.suppress(OSError):
                self._f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp_path)
        self._parts = []

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _storage_error(url: str, exc: BaseException) -> LynxError:
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return InputError(f"{url}: no space left on the device; nothing was written")
    if isinstance(exc, OSError) and exc.errno == errno.EDQUOT:
        return InputError(f"{url}: disk quota exceeded; nothing was written")
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError)):
        return as_lynx_error(url, exc)
    return InputError(f"{url}: cannot write ({exc}); nothing was written")


class SpillFile:
    """A scratch file for bytes that must be written after others (a single file's inline sections, which follow
    the anchor pages): a :class:`lynxkv.format.writer.ScratchSink` whose bytes wait on disk, not in memory. An
    unnamed temporary file in ``directory`` (the output's own, so that it takes room where the output does),
    gone when closed or when the process ends."""

    BLOCK = 8 << 20  # bytes read back at a time

    def __init__(self, directory: str | os.PathLike | None = None):
        import tempfile

        self._where = os.fspath(directory) if directory else "a temporary file"
        try:
            self._f = tempfile.TemporaryFile(dir=directory)
        except OSError as exc:
            raise _storage_error(self._where, exc) from None
        self.size = 0

    def write(self, data) -> None:
        try:
            self._f.write(data)
        except OSError as exc:
            raise _storage_error(self._where, exc) from None
        self.size += memoryview(data).nbytes

    def reserve(self, n: int) -> int:
        at = self.size
        self._f.seek(at + n)  # a hole until filled
        self.size += n
        return at

    def fill(self, offset: int, data) -> None:
        try:
            _pwrite_all(self._f, offset, data)
        except OSError as exc:
            raise _storage_error(self._where, exc) from None
        self.size = max(self.size, offset + memoryview(data).nbytes)

    def chunks(self, size: int | None = None):
        """The bytes written (the first ``size`` of them), in order, :attr:`BLOCK` at a time."""
        size = self.size if size is None else size
        try:
            self._f.flush()
            for at in range(0, size, self.BLOCK):
                yield os.pread(self._f.fileno(), min(self.BLOCK, size - at), at)
        except OSError as exc:
            raise _storage_error(self._where, exc) from None

    def read(self, offset: int, length: int) -> bytes:
        try:
            self._f.flush()
            return os.pread(self._f.fileno(), length, offset)
        except OSError as exc:
            raise _storage_error(self._where, exc) from None

    @property
    def file(self):
        """The scratch file object (for a reader of what was written)."""
        self._f.flush()
        return self._f

    def close(self) -> None:
        self._f.close()


def write_atomic(url: str | os.PathLike, data, storage_options: dict | None = None, *,
                 make_dirs: bool = False) -> None:
    """Write ``data`` to ``url`` atomically (see :class:`AtomicWriter`): a bytes-like object, or a list or tuple
    of them written one after the other (the parts of a file, never joined into one object locally)."""
    with AtomicWriter(url, storage_options, make_dirs=make_dirs) as w:
        for part in data if isinstance(data, (list, tuple)) else (data,):
            w.write(part)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary local path beside ``path`` for a library that writes files itself (safetensors); on
    success it is published under ``path`` exactly as :class:`AtomicWriter` publishes, on error removed."""
    w = AtomicWriter(os.fspath(path))
    if w.temp_path is None:
        w.abort()
        raise InputError(f"{path}: expected a local path")
    w._f.close()  # the library opens the path itself
    w._f = open(w.temp_path, "rb+")
    w._flusher = _Flusher(w._f.fileno())
    try:
        yield w.temp_path
    except OSError as exc:  # the library's own write failed: disk full, permission ...
        w.abort()
        raise _storage_error(os.fspath(path), exc) from None
    except BaseException:
        w.abort()
        raise
    w.commit()


def _pwrite_all(f, offset: int, data) -> None:
    """Write all of ``data`` at ``offset`` of the open file ``f`` (its buffered writes flushed first)."""
    f.flush()
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(f.fileno(), view[done:], offset + done)
