"""Paths and URLs: protocols, fsspec filesystems, sizes, ranged reads, removal; every failure one LynxError."""

from __future__ import annotations

import os

from lynxkv.errors import InputError, LynxError, TransientError

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


def shown_path(path: str) -> str:
    """``path`` as a message shows it: a NUL byte written as ``\\x00`` (never sent to a terminal as it is)."""
    return path.replace("\x00", "\\x00")


def refuse_nul(path: str) -> None:
    """An InputError naming ``path`` if it holds a NUL byte (the OS cannot open such a name: ``os.open`` raises a
    bare ValueError)."""
    if "\x00" in path:
        raise _nul_error(path)


def _nul_error(path: str) -> InputError:
    return InputError(f"{shown_path(path)}: a path may not contain a NUL byte")


def as_lynx_error(url: str, exc: BaseException) -> LynxError:
    """Every storage failure as a LynxError: the ones worth retrying as TransientError."""
    if isinstance(exc, LynxError):
        return exc
    if isinstance(exc, ValueError) and "\x00" in url:  # "embedded null byte": never worth a retry
        return _nul_error(url)
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
        raise as_lynx_error(url, exc) from None


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
        raise as_lynx_error(url, exc) from None


def exists(url: str, storage_options: dict | None = None) -> bool:
    try:
        if is_local(url):
            return os.path.lexists(local_path(url))
        fs, path = filesystem(url, storage_options)
        return bool(fs.exists(path))
    except LynxError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise as_lynx_error(url, exc) from None


def can_remove(url: str) -> bool:
    """Whether the storage layer can delete what is at ``url`` (an HTTP server, for one, cannot be asked to)."""
    return is_local(url) or protocol_of(url) not in ("http", "https")


def read_all(url: str, storage_options: dict | None = None) -> bytes:
    return read_range(url, 0, size_of(url, storage_options), storage_options)


def stamp_of(url: str) -> tuple[int, int, int, int] | None:
    """``(device, inode, size, mtime_ns)`` of a local file, which changes whenever the file is replaced or
    rewritten; None for a URL (an object store gives no such stamp) or a file that is gone."""
    if not is_local(url):
        return None
    try:
        st = os.stat(local_path(url))
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_stamped(url: str, storage_options: dict | None = None) -> tuple[bytes, tuple[int, int, int, int] | None]:
    """The whole object at ``url`` and the :func:`stamp_of` the very file it was read from (None for a URL).

    A local file is opened once, stamped with ``fstat`` before and after the read, so a file renamed over the path
    meanwhile never lends its stamp to the other's bytes; a file written in place while it was read (the stamps
    differ) is a TransientError, worth reading again later."""
    if not is_local(url):
        return read_all(url, storage_options), None
    try:
        with open(local_path(url), "rb") as f:
            before = os.fstat(f.fileno())
            data = f.read()
            after = os.fstat(f.fileno())
    except Exception as exc:  # noqa: BLE001
        raise as_lynx_error(url, exc) from None
    stamp = before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns
    if stamp != (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) or len(data) != before.st_size:
        raise TransientError(f"{url}: the file changed while it was read")
    return data, stamp


def remove(url: str, storage_options: dict | None = None) -> None:
    try:
        if is_local(url):
            os.unlink(local_path(url))
        else:
            fs, path = filesystem(url, storage_options)
            fs.rm(path)
    except Exception as exc:  # noqa: BLE001
        raise as_lynx_error(url, exc) from None
