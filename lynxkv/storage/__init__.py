"""Bytes at rest: the one place that opens paths and URLs, reads ranges, retries and writes atomically."""

from lynxkv.storage.atomic import AtomicWriter, SpillFile, atomic_path, clean_stale_temps, write_atomic
from lynxkv.storage.lock import WriterLock, writer_lock
from lynxkv.storage.locations import (
    ALLOW_ENV,
    allowed_locations,
    record_location,
    resolve_location,
    same_object,
    write_target,
)
from lynxkv.storage.retry import RetryPolicy, apart, is_transient, retried, within
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
    read_stamped,
    remove,
    size_of,
    stamp_of,
)

__all__ = [
    "ALLOW_ENV",
    "AtomicWriter",
    "ByteSource",
    "BytesSource",
    "FileObjSource",
    "FileSource",
    "RetryPolicy",
    "SpillFile",
    "WriterLock",
    "allowed_locations",
    "apart",
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
    "read_stamped",
    "record_location",
    "remove",
    "resolve_location",
    "retried",
    "same_object",
    "size_of",
    "stamp_of",
    "write_atomic",
    "within",
    "writer_lock",
    "write_target",
]
