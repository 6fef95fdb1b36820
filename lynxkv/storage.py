"""The storage layer: the one place that opens paths and URLs, reads byte ranges, retries, writes atomically and
decides where a segment lives.

Everything above it (the format's page reader, the cache API, the progressive reader, ``lynxkv tier``) reads
through a :class:`ByteSource` and writes through :class:`AtomicWriter`; nothing else opens a file or a URL.

- **Sources.** :func:`open_source` turns a path (memory-mapped), a URL (fsspec: ``s3://``, ``http(s)://``,
  ``memory://`` ...), bytes or a seekable file object into a :class:`ByteSource`: ``size`` and
  ``read(offset, length)``. :func:`read_range` / :func:`size_of` are the one-shot forms for URLs.
- **Retries.** :class:`RetryPolicy` and :func:`is_transient` say what is worth retrying (a
  :class:`~lynxkv.errors.TransientError`, a timeout, a reset connection; never a missing file or a bad checksum).
- **Atomic writes.** :class:`AtomicWriter` publishes an object under its name only when it is complete: locally a
  temporary file in the same directory, fsync, rename, directory fsync; on object stores one PUT.
  :func:`write_atomic` and :func:`atomic_path` are its two short forms.
- **Locations.** :func:`resolve_location` is the one function that says where a segment recorded in an anchor
  header lives; :func:`record_location` is its inverse (what to record for a segment written somewhere).

Object-store settings (endpoint, credentials) come from ``storage_options`` or fsspec's environment configuration
(``FSSPEC_S3='{"endpoint_url": ...}'``) and the usual AWS variables, so a cache opens with nothing but its URL.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import mmap
import os
import posixpath
import secrets
import threading
import zlib
from collections.abc import Iterator
from typing import Protocol

from lynxkv.errors import InputError, LynxError, TransientError

LOCAL_PROTOCOLS = ("file", "local")


# ---------------------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------------------
def has_protocol(url: str) -> bool:
    return "://" in url


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if has_protocol(url) else "file"


def is_local(url: str) -> bool:
    return protocol_of(url) in LOCAL_PROTOCOLS


def local_path(url: str) -> str:
    """``file:///a/b`` or ``/a/b`` -> ``/a/b``."""
    return url.split("://", 1)[1] if has_protocol(url) else url


def filesystem(url: str, storage_options: dict | None = None):
    """(fsspec filesystem, path inside it) for ``url``; a bad or unsupported URL is an InputError."""
    import fsspec.core

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise InputError(f"cannot open storage URL {url!r}: {exc}") from None


def _wrap(url: str, exc: BaseException) -> LynxError:
    """Every storage failure as a LynxError: the ones worth retrying as TransientError."""
    if isinstance(exc, LynxError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return InputError(f"{url}: no such file or object (it does not exist)")
    if isinstance(exc, PermissionError):
        return InputError(f"{url}: permission denied")
    if isinstance(exc, IsADirectoryError):
        return InputError(f"{url}: is a directory")
    return TransientError(f"{url}: {type(exc).__name__}: {exc}")


def size_of(url: str, storage_options: dict | None = None) -> int:
    """The size in bytes of the object at ``url``."""
    try:
        if is_local(url):
            return os.path.getsize(local_path(url))
        fs, path = filesystem(url, storage_options)
        fs.invalidate_cache(path)
        return int(fs.size(path))
    except Exception as exc:  # noqa: BLE001 - every storage failure becomes a LynxError
        raise _wrap(url, exc) from None


def read_range(url: str, start: int, end: int, storage_options: dict | None = None) -> bytes:
    """Bytes ``[start, end)`` of the object at ``url`` (one ranged GET for object stores)."""
    try:
        if is_local(url):
            with open(local_path(url), "rb") as f:
                f.seek(start)
                return f.read(end - start)
        fs, path = filesystem(url, storage_options)
        return bytes(fs.cat_file(path, start=start, end=end))
    except Exception as exc:  # noqa: BLE001
        raise _wrap(url, exc) from None


def exists(url: str, storage_options: dict | None = None) -> bool:
    try:
        if is_local(url):
            return os.path.lexists(local_path(url))
        fs, path = filesystem(url, storage_options)
        return bool(fs.exists(path))
    except LynxError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _wrap(url, exc) from None


def can_remove(url: str) -> bool:
    """Whether the storage layer can delete what is at ``url`` (an HTTP server, for one, cannot be asked to)."""
    return is_local(url) or protocol_of(url) not in ("http", "https")


def read_all(url: str, storage_options: dict | None = None) -> bytes:
    return read_range(url, 0, size_of(url, storage_options), storage_options)


def remove(url: str, storage_options: dict | None = None) -> None:
    try:
        if is_local(url):
            os.unlink(local_path(url))
        else:
            fs, path = filesystem(url, storage_options)
            fs.rm(path)
    except Exception as exc:  # noqa: BLE001
        raise _wrap(url, exc) from None


# ---------------------------------------------------------------------------------------------------------
# retries
# ---------------------------------------------------------------------------------------------------------
class RetryPolicy:
    """``attempts`` tries per read, sleeping ``base * 2**k`` (capped at ``cap``) between them; a read that does not
    answer within ``stall_timeout`` seconds counts as a transient failure."""

    def __init__(self, attempts: int = 4, base: float = 0.05, cap: float = 1.0, stall_timeout: float = 10.0):
        self.attempts = attempts
        self.base = base
        self.cap = cap
        self.stall_timeout = stall_timeout

    def delay(self, k: int) -> float:
        return min(self.cap, self.base * (2**k))


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: our TransientError, timeouts and connection-level OSErrors; not missing files, bad
    arguments or checksum failures."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, LynxError):
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    return isinstance(exc, (OSError, TimeoutError, ConnectionError, cf.TimeoutError))


# ---------------------------------------------------------------------------------------------------------
# byte sources
# ---------------------------------------------------------------------------------------------------------
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

    def close(self) -> None:
        pass


class FileSource:
    """A local file, memory-mapped: reading one page touches only that page's bytes."""

    def __init__(self, path: str | os.PathLike):
        import stat

        self.name = os.fspath(path)
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
            fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise _wrap(self.name, exc) from None
        self._f = os.fdopen(fd, "rb")
        try:
            st = os.fstat(self._f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise InputError(f"{self.name} is not a regular file; refusing to read it")
            self.size = st.st_size
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except InputError:
            self._f.close()
            raise
        except (OSError, ValueError) as exc:
            self._f.close()
            raise InputError(f"{self.name}: cannot map the file ({exc})") from None

    def read(self, offset: int, length: int) -> bytes:
        if self._mm is None:
            return b""
        return self._mm[offset:offset + length]

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
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
                raise _wrap(self.name, exc) from None

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
                raise _wrap(text, exc) from None
            try:
                return FileObjSource(f, text, size=getattr(f, "size", None), owns=True)
            except Exception as exc:  # noqa: BLE001
                f.close()
                raise _wrap(text, exc) from None
        return FileSource(local_path(text))
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return BytesSource(obj, name or "<bytes>")
    if hasattr(obj, "size") and hasattr(obj, "read") and not hasattr(obj, "seek"):
        return obj
    if hasattr(obj, "seek") and hasattr(obj, "read"):
        return FileObjSource(obj, name or f"<{getattr(obj, 'name', 'file')}>")
    raise InputError(f"cannot read a .lynx cache from a {type(obj).__name__}")


# ---------------------------------------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------------------------------------
_TMP_SUFFIX = ".tmp"


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


def clean_stale_temps(final: str) -> list[str]:
    """Remove the temporary files that a killed writer of ``final`` left behind (their process is gone)."""
    d, base = os.path.split(os.path.abspath(final))
    prefix = f".{base}."
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for n in names:
        if not (n.startswith(prefix) and n.endswith(_TMP_SUFFIX)):
            continue
        pid = n[len(prefix):-len(_TMP_SUFFIX)].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
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
        self.bytes_written = 0
        self.crc32 = 0
        self._done = False
        self._f = None
        if is_local(self.url):
            path = os.path.abspath(local_path(self.url))
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
                raise _wrap(self.url, exc) from None
            self._f = os.fdopen(fd, "wb")
            self._parts = None
        else:
            self._fs, self._path = filesystem(self.url, storage_options)
            self.temp_path = None
            self._parts = []

    def write(self, data) -> None:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes_written += len(data)
        if self._f is not None:
            try:
                self._f.write(data)
            except OSError as exc:
                self.abort()
                raise _storage_error(self.url, exc) from None
        else:
            self._parts.append(bytes(data))

    def commit(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            if self._f is not None:
                self._f.flush()
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
        return _wrap(url, exc)
    return InputError(f"{url}: cannot write ({exc}); nothing was written")


def write_atomic(url: str | os.PathLike, data, storage_options: dict | None = None, *,
                 make_dirs: bool = False) -> None:
    """Write ``data`` to ``url`` atomically (see :class:`AtomicWriter`)."""
    with AtomicWriter(url, storage_options, make_dirs=make_dirs) as w:
        w.write(data)


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
    try:
        yield w.temp_path
    except BaseException:
        w.abort()
        raise
    w.commit()


# ---------------------------------------------------------------------------------------------------------
# locations
# ---------------------------------------------------------------------------------------------------------
ALLOW_ENV = "LYNXKV_ALLOW_LOCATIONS"


def _normal(url: str) -> str:
    """A location in one spelling, for prefix checks: local paths absolute with symlinks resolved, URLs with a
    lower-case scheme and ``.``/``..``/``//`` folded."""
    if is_local(url):
        return os.path.realpath(local_path(url))
    proto, rest = url.split("://", 1)
    norm = posixpath.normpath(rest) if rest else ""
    if rest.endswith("/") and not norm.endswith("/"):
        norm += "/"
    return f"{proto.lower()}://{norm}"


def allowed_locations(allow=()) -> tuple[str, ...]:
    """The allow-list: ``allow`` plus the comma-separated prefixes in ``$LYNXKV_ALLOW_LOCATIONS``."""
    env = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    return tuple(str(a) for a in allow) + tuple(env)


def _under(target: str, prefix: str) -> bool:
    """``target`` is ``prefix`` or lies below it (``s3://b/x`` is not below ``s3://b/x-other``)."""
    if target == prefix:
        return True
    return target.startswith(prefix if prefix.endswith("/") else prefix + "/")


def _is_allowed(target: str, allow) -> bool:
    t = _normal(target)
    return any(_under(t, _normal(p)) for p in allowed_locations(allow))


def _regular_file(path: str, what: str) -> None:
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file or object (it does not exist)") from None
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot stat ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path} is not a regular file; refusing to read it")


def resolve_location(anchor: str | None, location: str, *, allow=(), what: str = "residual") -> str:
    """Where a segment recorded as ``location`` in the anchor at ``anchor`` (a path or URL; ``None`` or a
    ``<...>`` name when the anchor came from memory) lives -- and whether the reader may go there.

    The trust rule (spec/FORMAT.md, "Locations"): a file names only places the user named or allowed.

    - A relative location is taken relative to the anchor's directory (``x.lynxr`` next to
      ``s3://b/dir/x.lynx`` is ``s3://b/dir/x.lynxr``) and must stay inside it after normalisation; a local one
      must also stay inside after resolving symbolic links, and be a regular file (no FIFO, no device).
    - An absolute path or a URL, or a relative location that leaves the anchor's directory, is followed only
      when it lies under a prefix of the allow-list (``allow``, e.g. ``--allow-location s3://bucket/``, plus
      ``$LYNXKV_ALLOW_LOCATIONS``), compared after normalisation.

    Anything else is an InputError that names the location and how to allow it (``--residual`` names the
    segment explicitly and bypasses this function)."""
    hint = (f"pass --residual to name the {what} explicitly, or allow its place with --allow-location PREFIX "
            f"(or ${ALLOW_ENV})")
    if has_protocol(location) or location.startswith("/"):
        if _is_allowed(location, allow):
            return location
        raise InputError(f"the anchor records its {what} at {location!r}, outside the anchor's directory; {hint}")
    if anchor is None or anchor.startswith("<"):
        raise InputError(f"the anchor records its {what} at the relative location {location!r}, but the anchor "
                         f"was not read from a file; pass the {what} explicitly")
    if has_protocol(anchor) and not is_local(anchor):
        proto, rest = anchor.split("://", 1)
        base = posixpath.dirname(rest)
        target = f"{proto}://{posixpath.normpath(posixpath.join(base, location))}"
        inside = _under(_normal(target), _normal(f"{proto}://{base}/"))
    else:
        base = os.path.dirname(os.path.abspath(local_path(anchor)))
        target = os.path.normpath(os.path.join(base, location))
        inside = _under(target, base) and _under(os.path.realpath(target), os.path.realpath(base))
    if not inside and not _is_allowed(target, allow):
        raise InputError(f"the anchor records its {what} at {location!r}, which leads outside the anchor's "
                         f"directory; {hint}")
    if is_local(target):
        _regular_file(target, what)
    return target


def write_target(dest_anchor: str, location: str, *, what: str = "residual") -> str:
    """Where to write a copy of a segment recorded as ``location`` next to the anchor copy ``dest_anchor``: a
    relative location that stays inside the destination's directory (and is not a symbolic link)."""
    if has_protocol(location) or location.startswith("/"):
        raise InputError(f"the anchor records its {what} at the absolute location {location}; say where to write "
                         f"the copy with --residual-out")
    if has_protocol(dest_anchor) and not is_local(dest_anchor):
        proto, rest = dest_anchor.split("://", 1)
        base = posixpath.dirname(rest)
        target = f"{proto}://{posixpath.normpath(posixpath.join(base, location))}"
        inside = _under(_normal(target), _normal(f"{proto}://{base}/"))
    else:
        base = os.path.dirname(os.path.abspath(local_path(dest_anchor)))
        target = os.path.normpath(os.path.join(base, location))
        inside = _under(target, base) and not os.path.islink(target)
    if not inside:
        raise InputError(f"the anchor records its {what} at {location!r}, which leads outside the directory of "
                         f"{dest_anchor}; say where to write the copy with --residual-out")
    return target


def _canonical(url: str) -> str:
    return os.path.abspath(local_path(url)) if is_local(url) else url


def same_object(a: str, b: str) -> bool:
    return _canonical(a) == _canonical(b)


def record_location(anchor: str, segment: str) -> str:
    """How the anchor at ``anchor`` should record a segment at ``segment``: a relative path when both live in the
    same place (same local disk, same bucket or host), otherwise the absolute path or URL."""
    if is_local(anchor) and is_local(segment):
        return posixpath.join(*os.path.relpath(_canonical(segment), os.path.dirname(_canonical(anchor))).split(os.sep))
    if has_protocol(anchor) and has_protocol(segment) and protocol_of(anchor) == protocol_of(segment):
        a, r = anchor.split("://", 1)[1], segment.split("://", 1)[1]
        if a.split("/", 1)[0] == r.split("/", 1)[0]:  # same bucket / host
            return posixpath.relpath(r, posixpath.dirname(a))
    return _canonical(segment)
