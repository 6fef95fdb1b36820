"""Storage tiers: either segment of a cache at any fsspec URL (local path, ``file://``, ``s3://``, ``http(s)://``,
``memory://``), with byte-range reads and atomic writes.

Atomicity. A reader must never see half a segment under its real name:
- local files: write ``.NAME.tmp-<random>`` in the same directory, fsync, ``os.replace`` (atomic on POSIX);
- object stores (s3, gcs, memory, ...): one PUT of the whole object (``pipe_file``), or a multipart upload
  that only becomes visible when it completes; an aborted upload leaves nothing.

Object-store settings (endpoint, credentials) come from ``storage_options`` or, for a restarted process, from
fsspec's environment configuration (``FSSPEC_S3='{"endpoint_url": ...}'``) or the usual AWS variables: a cache
is opened with nothing but its path.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import zlib

from lynxkv.errors import InputError, LynxError

LOCAL_PROTOCOLS = ("file", "local")


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


def resolve_location(base_url: str, location: str) -> str:
    """Where a segment recorded as ``location`` lives, for a cache whose anchor is at ``base_url``.

    An absolute location (a URL with a protocol, or an absolute path) is used as is; a relative one is taken
    relative to the directory holding the anchor (``x.lynxr`` next to ``s3://b/dir/x.lynx`` is
    ``s3://b/dir/x.lynxr``)."""
    if has_protocol(location) or location.startswith("/"):
        return location
    if has_protocol(base_url):
        proto, rest = base_url.split("://", 1)
        return f"{proto}://{posixpath.normpath(posixpath.join(posixpath.dirname(rest), location))}"
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(base_url)), location))


def _wrap(url: str, exc: Exception) -> LynxError:
    if isinstance(exc, LynxError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return InputError(f"{url}: no such file or object")
    return TransientError(f"{url}: {type(exc).__name__}: {exc}")


class TransientError(LynxError):
    """A storage or network failure that may go away when retried (connection reset, timeout, 5xx)."""


def segment_size(url: str, storage_options: dict | None = None) -> int:
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


def read_all(url: str, storage_options: dict | None = None) -> bytes:
    return read_range(url, 0, segment_size(url, storage_options), storage_options)


def write_bytes_atomic(url: str, data: bytes, storage_options: dict | None = None) -> None:
    """Write one segment's bytes to ``url`` atomically (temp + rename locally, a single PUT elsewhere)."""
    with AtomicWriter(url, storage_options) as w:
        w.write(data)


class AtomicWriter:
    """A streaming writer that publishes the object under its name only on :meth:`commit` (or a clean ``with``
    exit); :meth:`abort` (or an exception inside ``with``) leaves nothing under the real name."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.bytes_written = 0
        self.crc32 = 0
        self._done = False
        if is_local(url):
            path = os.path.abspath(local_path(url))
            d = os.path.dirname(path)
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as exc:
                raise InputError(f"{url}: cannot create directory {d} ({exc.strerror or exc})") from None
            self._final = path
            self._tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
            self._f = open(self._tmp, "wb")
            self._parts = None
        else:
            self._fs, self._path = filesystem(url, storage_options)
            self._f = None
            self._parts = []  # object stores: one PUT of the whole object on commit

    def write(self, data: bytes) -> None:
        self.crc32 = zlib.crc32(data, self.crc32)
        self.bytes_written += len(data)
        if self._f is not None:
            self._f.write(data)
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
                os.replace(self._tmp, self._final)
            else:
                self._fs.pipe_file(self._path, b"".join(self._parts))
                self._parts = []
                self._fs.invalidate_cache(self._path)
        except LynxError:
            raise
        except Exception as exc:  # noqa: BLE001
            self.abort()
            raise _wrap(self.url, exc) from None

    def abort(self) -> None:
        self._done = True
        if self._f is not None:
            try:
                self._f.close()
            finally:
                if os.path.exists(self._tmp):
                    os.unlink(self._tmp)
        self._parts = []

    def __enter__(self) -> "AtomicWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
