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

Modules: ``urls`` (protocols, sizes, ranged reads, removal), ``retry``, ``sources``, ``atomic``,
``locations``.
"""

from lynxkv.storage.atomic import AtomicWriter, atomic_path, clean_stale_temps, write_atomic
from lynxkv.storage.locations import (
    ALLOW_ENV,
    allowed_locations,
    record_location,
    resolve_location,
    same_object,
    write_target,
)
from lynxkv.storage.retry import RetryPolicy, is_transient
from lynxkv.storage.sources import ByteSource, BytesSource, FileObjSource, FileSource, open_source
from lynxkv.storage.urls import (
    can_remove,
    exists,
    filesystem,
    has_protocol,
    is_local,
    local_path,
    protocol_of,
    read_all,
    read_range,
    remove,
    size_of,
)

__all__ = [
    "ALLOW_ENV",
    "AtomicWriter",
    "ByteSource",
    "BytesSource",
    "FileObjSource",
    "FileSource",
    "RetryPolicy",
    "allowed_locations",
    "atomic_path",
    "can_remove",
    "clean_stale_temps",
    "exists",
    "filesystem",
    "has_protocol",
    "is_local",
    "is_transient",
    "local_path",
    "open_source",
    "protocol_of",
    "read_all",
    "read_range",
    "record_location",
    "remove",
    "resolve_location",
    "same_object",
    "size_of",
    "write_atomic",
    "write_target",
]
