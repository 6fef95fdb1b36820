"""The lynx storage tier for LMCache: the anchor and the residual of each chunk as separate objects, on separate
paths (local directories or any fsspec URL: a RAM disk or local SSD for the anchor, S3 or a shared file system
for the residual).

Loaded by ``lmcache server`` as a plugin tier, with the ``lynx`` serde in front of it::

    --l2-adapter '{"type": "plugin", "module_path": "lynxkv.integrations.lmcache.adapter",
                   "class_name": "LynxL2Adapter",
                   "adapter_params": {"anchor_path": "/fast/lynx", "residual_path": "/bulk/lynx"},
                   "serde": {"type": "lynx", "kv_heads": 8}}'

Objects. A chunk with key (model, kv_rank, object group, chunk hash, cache salt) is stored as
``<anchor_path>/<name>.lynx`` and ``<residual_path>/<name>.lynxr`` (and, when the serde writes exact segments,
``<exact_path>/<name>.lynxe``, ``exact_path`` defaulting to ``residual_path``) where ``<name>`` is
``<model with / as %2F>@<kv_rank>@<group>@<hash hex>[@<salt>]``: the model name is part of the key, and each
file is a valid lynx segment (``lynxkv inspect``/``verify`` read them; the anchor records where its residual
is, relative to it). The residual is written first, then the exact segment, the anchor last, each atomically: a
chunk is present exactly when its anchor is, and an anchor never points at a missing residual or exact file.

Reads. A lookup is a hit when the anchor and the residual exist (and the exact file, with ``"exact": true`` in
the adapter's parameters). A load reads them, and the exact file when the anchor records one, and checks every
header, index and page CRC, that each side segment belongs to the anchor (``cache_id``) and that the exact
segment rebuilds every page's original bytes, before it reports the chunk as loaded; anything wrong (missing,
truncated, corrupted, another cache's residual or exact segment) is a miss for that chunk only, logged with the
reason, and never reaches the KV buffer. Anchor objects stand alone: ``lynxkv decode --anchor-only`` and the
progressive reader use them without the residual.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import posixpath
import threading

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

import lynxkv.integrations.lmcache.serde  # noqa: F401  (registers the "lynx" serde before LMCache builds it)
from lynxkv.cache import verify_file
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.reader import read_anchor_header
from lynxkv.integrations.lmcache.chunk import anchor_length, parse_flag, split_segments
from lynxkv.storage import BytesSource, filesystem, read_all, size_of, write_atomic
from lynxkv.integrations.lmcache.source import exact_object_path, object_name, object_paths

log = init_logger(__name__)  # LMCache's log, so that `lmcache server` shows what the lynx tier did


class LynxL2Adapter(L2AdapterInterface):
    """An LMCache L2 tier over two lynx storage tiers (see the module docstring)."""

    def __init__(self, params: dict, l1_memory_desc=None):
        super().__init__()
        try:
            self.anchor_path = str(params["anchor_path"])
        except (KeyError, TypeError):
            raise InputError("lynx tier: adapter_params needs anchor_path (and optionally residual_path)") from None
        self.residual_path = str(params.get("residual_path") or self.anchor_path)
        self.exact_path = str(params.get("exact_path") or self.residual_path)
        self.require_exact = parse_flag(params.get("exact", False), "lynx tier: exact")  # lookups want it too
        for p in {self.anchor_path, self.residual_path, self.exact_path}:
            if "://" not in p:
                os.makedirs(p, exist_ok=True)
        self._store_efd, self._lookup_efd, self._load_efd = (create_event_notifier() for _ in range(3))
        self._lock = threading.Lock()
        self._next = 0
        self._stored: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}
        self._pool = cf.ThreadPoolExecutor(int(params.get("workers", 2)), thread_name_prefix="lynx-tier")
        log.info("lynx tier: anchors in %s, residuals in %s", self.anchor_path, self.residual_path)

    # -- paths
    def paths(self, key: ObjectKey) -> tuple[str, str]:
        return object_paths(key, self.anchor_path, self.residual_path)

    def exact_file(self, key: ObjectKey) -> str:
        """Where the chunk's exact segment goes: ``<exact_path>/<name>.lynxe``."""
        return exact_object_path(key, self.exact_path)

    def _residual_location(self, anchor: str, residual: str) -> str:
        """What the anchor records: a side file's path relative to the anchor's directory (or its URL)."""
        if "://" in anchor or "://" in residual:
            return residual if posixpath.dirname(anchor) != posixpath.dirname(residual) else \
                posixpath.basename(residual)
        return os.path.relpath(residual, os.path.dirname(anchor))

    # -- plumbing
    def _task(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list) -> int:
        tid = self._task()
        self._pool.submit(self._store, tid, keys, objects)
        return tid

    def _store(self, tid: int, keys: list[ObjectKey], objects: list) -> None:
        ok, nbytes, stored, sizes = True, 0, [], []
        for key, obj in zip(keys, objects):
            apath, rpath = self.paths(key)
            try:
                if _exists(apath):
                    continue
                data = bytes(memoryview(obj.byte_array).cast("B"))
                single = data[:anchor_length(data)]
                epath = self.exact_file(key)
                anchor, residual, exact = split_segments(single, self._residual_location(apath, rpath),
                                                         self._residual_location(apath, epath))
                sides = [(rpath, residual)] + ([(epath, exact)] if exact is not None else [])
                try:
                    for path, payload in sides:
                        write_atomic(path, payload)
                    write_atomic(apath, anchor)
                except BaseException:
                    for path, _ in sides:  # side files without their anchor are a miss that only fills the disk
                        _remove(path)
                    raise
                n = len(anchor) + sum(len(p) for _, p in sides)
                nbytes += n
                stored.append(key)
                sizes.append(n)
            except Exception as exc:  # noqa: BLE001 - LMCache wants a task result, not an exception
                log.warning("lynx tier: cannot store %s: %s", object_name(key), exc)
                ok = False
        if stored:
            self._notify_keys_stored(stored, sizes)
            log.info("lynx tier: stored %d chunks for %s (%d bytes, anchor and residual apart)", len(stored),
                     stored[0].model_name, nbytes)
        with self._lock:
            self._stored[tid] = L2StoreResult(ok, nbytes)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    # -- lookup
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs=None) -> int:
        tid = self._task()
        self._pool.submit(self._lookup, tid, keys)
        return tid

    def _lookup(self, tid: int, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            if all(_exists(p) for p in self.paths(key)) and (not self.require_exact or _exists(self.exact_file(key))):
                bitmap.set(i)
        with self._lock:
            self._lookups[tid] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: int):
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        pass  # no locks: a chunk deleted between lookup and load is a miss at load time

    # -- load
    def submit_load_task(self, keys: list[ObjectKey], objects: list) -> int:
        tid = self._task()
        self._pool.submit(self._load, tid, keys, objects)
        return tid

    def read_chunk(self, key: ObjectKey) -> tuple[bytes, ...]:
        """(anchor, residual) of one chunk, and its exact file when the anchor records one of its own, every
        CRC checked (and the exact segment's rebuild); a LynxError if any is missing or bad."""
        apath, rpath = self.paths(key)
        anchor, residual = read_all(apath), read_all(rpath)
        h = read_anchor_header(BytesSource(anchor, "anchor"), exact_size=False)
        ex = h.segment(c.SEGMENT_EXACT)
        exact = read_all(self.exact_file(key)) if ex is not None and ex.placement == c.PLACEMENT_EXTERNAL else None
        if self.require_exact and ex is None:
            raise LynxError("this chunk was stored without an exact segment")
        findings = verify_file(anchor, residual=residual, exact=exact)
        if findings:
            raise LynxError(f"{findings[0]}" + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""))
        return (anchor, residual) if exact is None else (anchor, residual, exact)

    def _load(self, tid: int, keys: list[ObjectKey], objects: list) -> None:
        bitmap = Bitmap(len(keys))
        for i, (key, obj) in enumerate(zip(keys, objects)):
            try:
                files = self.read_chunk(key)
                buf = memoryview(obj.byte_array).cast("B")
                n = sum(len(f) for f in files)
                if n > len(buf):
                    raise LynxError(f"{n} bytes do not fit the {len(buf)}-byte buffer")
                at = 0
                for f in files:  # the anchor, then the residual, then the exact file (open_chunk's order)
                    buf[at:at + len(f)] = f
                    at += len(f)
                bitmap.set(i)
            except Exception as exc:  # noqa: BLE001 - a bad chunk is a miss, never data
                log.warning("lynx tier: %s is a miss: %s", object_name(key), exc)
        loaded = [keys[i] for i in bitmap.get_indices_list()]
        if loaded:
            self._notify_keys_accessed(loaded)
            log.info("lynx tier: retrieved %d of %d chunks (anchor + residual, every CRC checked) for %s",
                     len(loaded), len(keys), loaded[0].model_name)
        with self._lock:
            self._loads[tid] = bitmap
        self._load_efd.notify()

    def query_load_result(self, task_id: int):
        with self._lock:
            return self._loads.pop(task_id, None)

    # -- the rest
    def delete(self, keys: list[ObjectKey]) -> None:
        gone, sizes = [], []
        for key in keys:
            size = 0
            apath, rpath = self.paths(key)
            for p in (apath, rpath, self.exact_file(key)):  # the anchor first: a chunk without one is absent
                try:
                    fs, path = filesystem(p)
                    size += fs.size(path)
                    fs.rm(path)
                except (OSError, LynxError):
                    pass
            if size:
                gone.append(key)
                sizes.append(size)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def report_status(self) -> dict:
        return {"is_healthy": True, "type": "LynxL2Adapter", "anchor_path": self.anchor_path,
                "residual_path": self.residual_path, "exact_path": self.exact_path}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for n in (self._store_efd, self._lookup_efd, self._load_efd):
            n.close()


def _exists(url: str) -> bool:
    try:
        size_of(url)
        return True
    except (LynxError, OSError):
        return False


def _remove(url: str) -> None:
    try:
        fs, path = filesystem(url)
        fs.rm(path)
    except (OSError, LynxError):
        pass
