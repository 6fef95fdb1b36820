"""Serving a cache while it is written: :class:`GrowingFile` (a file of known size whose bytes become final piece by
piece) and :class:`PublishServer` (``lynxkv serve``'s server over such files).

What a reader can see. A growing file is a :class:`~lynxkv.format.writer.PageSink`: the writer's ``write`` appends
final bytes (a stored page is never changed once written), ``reserve`` leaves a hole (the header and the page
indexes, known last), ``fill`` puts the hole's bytes in and makes them final. The server answers a range request
only with final bytes: each chunk of a response waits until every byte of it is final, so a reader of a cache
still being published receives the pages as they are produced and the header once it is whole, never a byte that
could still change. A reader that asks for bytes not yet final waits for them, at most ``wait_timeout`` seconds;
then, or when the publisher fails (:meth:`GrowingFile.fail`), the response is cut off (the connection reset), so
the reader sees a transfer error and never a short or wrong body. The size is fixed before the first byte (format
v1 page sizes follow from the scheme and the shape): ``HEAD`` and ``Content-Length`` tell the final size at once.

Provisional bytes. :meth:`GrowingFile.provisional` fills a hole's bytes ahead of time and makes a prefix of them
final: the anchor header's fixed part (its first 96 bytes: magic, version, flags, ``header_length``, the shape,
the scheme and the ``cache_id``) does not depend on any page, so a reader learns the layout while the pages are
still being encoded. The final ``fill`` must agree with every byte made final early, or the file fails.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.parse
from typing import Callable

from lynxkv.errors import LynxError
from lynxkv.serve.resources import Resource, ServedCache
from lynxkv.serve.server import CacheServer

WAIT_TIMEOUT = 120.0  # seconds a response waits for bytes that are not final yet


class PublishFailed(ConnectionAbortedError):
    """The publisher failed or a wait timed out: the response in progress is cut off."""


class GrowingFile:
    """A file of ``size`` bytes written in order (a :class:`~lynxkv.format.writer.PageSink`), readable as its bytes
    become final (see the module docstring). ``name`` is the resource kind ("anchor", "residual"), ``path`` its URL
    path (without the leading ``/``)."""

    def __init__(self, name: str, path: str, size: int):
        self.name, self.path, self.size = name, path, int(size)
        self.data = bytearray(self.size)
        self._final: list[list[int]] = []  # sorted, disjoint [start, end) runs of final bytes
        self._early: list[tuple[int, int]] = []  # runs made final by provisional(): a fill must agree with them
        self._pos = 0
        self._holes: dict[int, int] = {}
        self._error: str | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- the writer's side (a PageSink)
    def write(self, data) -> None:
        n = memoryview(data).nbytes
        at = self._pos
        self._put(at, data, n)
        self._pos = at + n

    def reserve(self, n: int) -> int:
        at = self._pos
        if at + n > self.size:
            self.fail(f"{self.name}: {at + n} bytes written, {self.size} planned")
            raise LynxError(f"{self.name}: the cache came out longer than planned ({at + n} > {self.size} bytes)")
        self._holes[at] = n
        self._pos = at + n
        return at

    def fill(self, offset: int, data) -> None:
        n = memoryview(data).nbytes
        if self._holes.pop(offset, None) != n:
            raise LynxError(f"{self.name}: fill of {n} bytes at {offset} matches no reserve")
        view = memoryview(data).cast("B")
        for a, b in self._early:
            if a >= offset and b <= offset + n and bytes(view[a - offset:b - offset]) != bytes(self.data[a:b]):
                self.fail(f"{self.name}: bytes {a}-{b} changed after they were served")
                raise LynxError(f"{self.name}: bytes {a}-{b} changed after they were published")
        self._put(offset, data, n)

    def provisional(self, offset: int, data, final_bytes: int) -> None:
        """Put ``data`` in the hole at ``offset`` ahead of its fill; its first ``final_bytes`` become final now."""
        view = memoryview(data).cast("B")
        self.data[offset:offset + len(view)] = view
        if final_bytes:
            self._early.append((offset, offset + final_bytes))
            self._mark(offset, offset + final_bytes)

    def _put(self, at: int, data, n: int) -> None:
        if at + n > self.size:
            self.fail(f"{self.name}: {at + n} bytes written, {self.size} planned")
            raise LynxError(f"{self.name}: the cache came out longer than planned ({at + n} > {self.size} bytes)")
        self.data[at:at + n] = memoryview(data).cast("B")
        self._mark(at, at + n)

    def _mark(self, a: int, b: int) -> None:
        with self._lock:
            runs = self._final
            runs.append([a, b])
            runs.sort()
            merged = [runs[0]]
            for r in runs[1:]:
                if r[0] <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], r[1])
                else:
                    merged.append(r)
            self._final = merged
            self._wake()

    def fail(self, why: str) -> None:
        """Cut off every response waiting for bytes of this file, now and later."""
        with self._lock:
            if self._error is None:
                self._error = why
            self._wake()

    def _wake(self) -> None:  # under the lock
        waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop has closed: nobody waits there any more
                pass

    # -- the reader's side
    @property
    def complete(self) -> bool:
        """Every byte is final."""
        with self._lock:
            return self._final == [[0, self.size]] or self.size == 0

    @property
    def error(self) -> str | None:
        return self._error

    def final_at(self, a: int, b: int) -> bool:
        with self._lock:
            return any(s <= a and b <= e for s, e in self._final)

    async def wait_final(self, a: int, b: int, timeout: float) -> None:
        """Return once bytes ``[a, b)`` are final; :class:`PublishFailed` after ``timeout`` seconds or once the
        file failed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            with self._lock:
                if self._error is not None:
                    raise PublishFailed(self._error)
                if b <= a or any(s <= a and b <= e for s, e in self._final):
                    return
                ev = asyncio.Event()
                self._waiters.append((loop, ev))
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                await asyncio.wait_for(ev.wait(), left)
            except asyncio.TimeoutError:
                raise PublishFailed(f"{self.name} bytes {a}-{b} not written within {timeout:g} s") from None


def _resource(f: GrowingFile, tag: str) -> Resource:
    # The bytes are not known yet, so the ETag cannot be their digest: the cache's random id names them instead
    # (strong: a cache id's bytes, once final, never change). No date: the file is being written.
    return Resource(f.name, f.path, f.data, 0, f'"lynx-{tag}-{f.name}"', None)


class PublishServer(CacheServer):
    """:class:`~lynxkv.serve.server.CacheServer` over growing files (see the module docstring): the same ranges,
    DSCP marks, priorities and connection bounds, every chunk of a response sent only once it is final.
    ``tag`` (hex of the cache id) names the bytes in the ETags."""

    def __init__(self, files: list[GrowingFile], tag: str, *, wait_timeout: float = WAIT_TIMEOUT,
                 log: Callable[[str], None] | None = None, **options):
        by_name = {f.name: f for f in files}
        served = ServedCache(_resource(by_name["anchor"], tag),
                             _resource(by_name["residual"], tag) if "residual" in by_name else None, False)
        self.files = by_name
        self.wait_timeout = wait_timeout
        self.requested = threading.Event()  # a client has asked for a resource (GET or HEAD)
        super().__init__(served, log=log, **options)

    async def _handle(self, request):
        if request.path not in ("/", "/manifest.json"):
            self.requested.set()
        return await super()._handle(request)

    def describe(self) -> dict:
        def row(f: GrowingFile | None):
            return None if f is None else {"path": f.path, "size": f.size, "complete": f.complete}

        return {"url": self.url, "host": self.host, "port": self.port, "anchor": row(self.files.get("anchor")),
                "residual": row(self.files.get("residual")), "exact": None, "relocated": False,
                "publishing": not all(f.complete for f in self.files.values())}

    @property
    def url(self) -> str:
        return self.base_url + "/" + urllib.parse.quote(self.files["anchor"].path)

    async def _final(self, res: Resource, a: int, b: int) -> None:
        f = self.files.get(res.name)
        if f is not None:
            await f.wait_final(a, b, self.wait_timeout)
