"""``lynxkv serve``: one cache over HTTP (aiohttp): :class:`CacheServer`, range requests, connection bounds.

Resources. The anchor file is ``GET /<anchor file name>``; an external residual is ``GET /<location>`` where
``<location>`` is the relative location its anchor header records, and an external exact segment
likewise, so the URL of the anchor is all a client needs (``open_progressive("http://host:port/x.lynx")`` resolves the residual next to it, exactly as for a file
or an S3 object). Each answers ``GET`` and ``HEAD`` (the same headers, no body: ``Content-Length``,
``Accept-Ranges: bytes``, a strong ``ETag``, ``Last-Modified`` once it validates) and RFC 9110 range requests as
:mod:`lynxkv.serve.ranges` says (one range -> 206 with ``Content-Range``; several ranges are ignored -> 200 with the
whole resource; ``If-Range`` with a stale validator -> 200 with the whole resource), so any HTTP client resumes a
transfer with a range request. ``GET /`` is a JSON manifest (resource paths, sizes, CRC-32s, ETags). Anything else
is a clean 4xx with a one-line text body: 404 for another path, 405 for another method, 400 for a malformed
``Range``, 416 (``Content-Range: bytes */<size>``) for an unsatisfiable one; malformed HTTP itself gets aiohttp's
400. When the cache's files change on disk the server reads and checks them again and serves the new version, each
response from one version (:mod:`lynxkv.serve.versions`).

Bounds (:mod:`lynxkv.serve.connections`). At most ``max_connections`` connections (at the cap the longest-idle
one makes room; when all are busy the new one gets a 503); ``header_timeout`` to deliver a request header;
``idle_timeout`` for an idle keep-alive connection and for a client that takes no bytes (then reset); at most
``write_buffer`` bytes queued per connection and ``max_buffered`` for all of them, past which only clients that
keep up get more. One thread runs the event loop whatever the number of clients, and a connection's state is
dropped when it closes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import urllib.parse
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from lynxkv.errors import LynxError
from lynxkv.serve.connections import Connections, Limits, ServerStats, reset
from lynxkv.serve.egress import QUANTUM, Egress
from lynxkv.serve.ranges import HTTPRefusal, http_date, parse_range, select
from lynxkv.serve.resources import ServedCache, set_dscp
from lynxkv.serve.versions import Versions
from lynxkv.stream.link import ANCHOR, EXACT, RESIDUAL

_CLASS = {"anchor": ANCHOR, "residual": RESIDUAL, "exact": EXACT}  # the egress class of each resource

__all__ = ["CacheServer", "HTTPRefusal", "parse_range"]

WRITE_BUFFER = Limits.write_buffer  # per connection: transport high-water mark and kernel send buffer (default)


class CacheServer:
    """Serves one :class:`ServedCache` over HTTP on ``host:port`` (0: a free port); see the module docstring.

    ``start()`` runs it on a thread of its own (``with CacheServer(...) as srv:``); ``serve_forever(until)`` runs
    it on the calling thread until ``until()`` is true or ``close()`` is called."""

    def __init__(self, cache: ServedCache | None, *, host: str = "127.0.0.1", port: int = 0,
                 bandwidth: float | None = None, dscp_anchor: int | None = None, dscp_residual: int | None = None,
                 dscp_exact: int | None = None,
                 max_connections: int = Limits.max_connections, idle_timeout: float = Limits.idle_timeout,
                 header_timeout: float = Limits.header_timeout, write_buffer: int = Limits.write_buffer,
                 max_buffered: int = Limits.max_buffered, quantum: int = QUANTUM,
                 log: Callable[[str], None] | None = None):
        self.bandwidth = bandwidth
        self.dscp = {"anchor": dscp_anchor, "residual": dscp_residual,
                     "exact": dscp_residual if dscp_exact is None else dscp_exact}
        self.limits = Limits(max_connections=max_connections, header_timeout=header_timeout,
                             idle_timeout=idle_timeout, write_buffer=write_buffer, max_buffered=max_buffered)
        self.max_connections, self.idle_timeout = max_connections, idle_timeout
        self.quantum = quantum
        self.log = log or (lambda msg: None)
        self.stats = ServerStats()
        # (None: a subclass that serves several caches keeps their versions itself, see lynxkv.serve.store)
        self._versions = None if cache is None else Versions(cache, log=self.log, swapped=self._swapped)
        self._backlog = max(256, min(4096, max_connections))
        self._sock = socket.create_server((host, port), backlog=self._backlog)
        self._sock.setblocking(False)
        if dscp_anchor is not None:  # the handshake's SYN-ACK (and a connection until its first response) goes
            set_dscp(self._sock, dscp_anchor)  # as the anchor does, not in the default class behind other traffic
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns = Connections(self.limits, self.stats)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def cache(self) -> ServedCache:
        """The version of the cache being served (read again when its files change on disk)."""
        return self._versions.served

    @property
    def resources(self) -> dict:
        """URL path -> the resource served there, in the current version."""
        return self._versions.by_path

    def _swapped(self, old: ServedCache, new: ServedCache) -> None:
        before = {r.name: r.etag for r in old.resources()}
        for r in new.resources():
            if before.get(r.name) != r.etag:
                self.stats.uncover(r.name)
        self.log("the cache changed on disk: serving the version now there (read and checked again)")

    # -- addresses
    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The anchor's URL: what a client opens."""
        return self.base_url + "/" + urllib.parse.quote(self.cache.anchor.path)

    def describe(self) -> dict:
        def row(r):
            return None if r is None else {"path": r.path, "size": len(r.data), "crc32": r.crc32, "etag": r.etag}

        cache = self.cache
        return {"url": self.url, "host": self.host, "port": self.port, "anchor": row(cache.anchor),
                "residual": row(cache.residual), "exact": row(cache.exact), "relocated": cache.relocated}

    @property
    def connections(self) -> int:
        return len(self._conns)

    def counters(self) -> dict:
        """The server's counters (requests served, connections refused and closed by the limits, peaks)."""
        return {**self.stats.counters(), "connections": len(self._conns), "buffered": self._conns.buffered}

    def sent_once(self) -> bool:
        """Every byte of every resource (anchor, residual, exact segment) has gone out at least once."""
        return all(self.stats.covered(r.name, len(r.data)) for r in self.resources.values())

    # -- lifecycle
    def start(self) -> "CacheServer":
        self._thread = threading.Thread(target=self.serve_forever, name="lynxkv-serve", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise LynxError("the HTTP server did not start")
        return self

    def serve_forever(self, until: Callable[[], bool] | None = None, *, stop_signals: tuple = ()) -> None:
        """Serve until ``until()`` holds, :meth:`close` is called, or one of ``stop_signals`` arrives (main thread
        only; e.g. ``(signal.SIGTERM, signal.SIGINT)``): each then closes the server gracefully and returns. A signal
        the process ignored when it started (``SIGINT`` in a background job) stays ignored."""
        asyncio.run(self._main(until, stop_signals))

    def close(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "CacheServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    async def _main(self, until: Callable[[], bool] | None, stop_signals: tuple = ()) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in stop_signals:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._loop.add_signal_handler(sig, self._stop.set)
        self._egress = Egress(self.bandwidth)
        # aiohttp's own keep-alive timer is only a backstop: the watchdog applies the limits (and counts them)
        backstop = max(self.limits.idle_timeout, self.limits.header_timeout) + 5.0
        server = _Server(self, self._handle, keepalive_timeout=backstop, max_line_size=8190,
                         max_field_size=8190, logger=_OneLineLogger(self.log))
        aserver = await self._loop.create_server(server, sock=self._sock, backlog=self._backlog)
        watchdog = self._loop.create_task(self._watchdog(until))
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            watchdog.cancel()
            aserver.close()
            await server.shutdown(1.0)
            self._egress.close()
            for t in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                t.cancel()
            for handler, _ in self._conns.items():
                self._conns.drop(handler)

    async def _watchdog(self, until: Callable[[], bool] | None) -> None:
        """Close connections past their header or idle deadline and recount the bytes queued; stop once
        ``until()`` holds."""
        while True:
            await asyncio.sleep(min(0.2, self.limits.header_timeout / 4, self.limits.idle_timeout / 4))
            self._conns.expire()
            self._conns.recount()
            if until is not None and until():
                # Stop only once every response has left this process: no request in progress and nothing in
                # a transport's buffer (the kernel delivers what it holds after a graceful close).
                t_end = time.monotonic() + self.idle_timeout
                while time.monotonic() < t_end and any(
                        st.active or (h.transport is not None and h.transport.get_write_buffer_size())
                        for h, st in self._conns.items()):
                    await asyncio.sleep(0.05)
                self._stop.set()
                return

    # -- requests
    async def _handle(self, request):
        st = self._conns.started(request.protocol)
        self.stats.served += 1
        try:
            if st is not None and st.refusing:
                n = self.limits.max_connections
                resp = web.Response(status=503, text=f"lynxkv: server busy: {n} connections open, the limit; "
                                    "retry later\n", headers={"Retry-After": "1"})
                resp.force_close()
                return resp
            return await self._respond(request, st)
        except HTTPRefusal as exc:
            return web.Response(status=exc.status, text=f"lynxkv: {exc}\n", headers=exc.headers)
        finally:
            if st is not None:
                self._conns.finished(st)

    async def _respond(self, request, st):
        if request.method not in ("GET", "HEAD"):
            raise HTTPRefusal(405, f"method {request.method} not allowed: GET or HEAD", {"Allow": "GET, HEAD"})
        if request.path in ("/", "/manifest.json"):
            await self._refresh()
            return web.Response(text=json.dumps(self.describe()) + "\n", content_type="application/json")
        res, dated = await self._lookup(request.raw_path.split("?", 1)[0], request.path)
        size = len(res.data)
        status, start, end = select(request.headers.get("Range"), request.headers.get("If-Range"), size,
                                    etag=res.etag, modified=res.modified, date_is_strong=dated)
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", "ETag": res.etag,
                   "Content-Length": str(end - start)}
        if dated:
            headers["Last-Modified"] = http_date(res.modified)
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        tos = None
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        dscp = self.dscp[res.name]
        if sock is not None and dscp is not None:
            tos = set_dscp(sock, dscp)
        record = {"resource": res.name, "start": start, "end": end, "sent": 0, "tos": tos, "status": status,
                  "seconds": None}
        self.stats.requests.append(record)
        if len(self.stats.requests) > 10000:  # a bounded log
            del self.stats.requests[:5000]
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = end - start
        if request.method == "HEAD":
            await resp.prepare(request)
            record["seconds"] = 0.0
            return resp
        t0 = time.perf_counter()
        await resp.prepare(request)
        cls = _CLASS[res.name]
        view = memoryview(res.data)
        try:
            for a in range(start, end, self.quantum):
                b = min(a + self.quantum, end)
                await self._final(res, a, b)
                await self._egress.grant(cls, b - a)
                if st is not None:
                    await self._conns.room(st, request.transport)
                await asyncio.wait_for(resp.write(view[a:b]), self.idle_timeout)
                if st is not None:
                    self._conns.account(st, request.transport)
                record["sent"] += b - a
            await asyncio.wait_for(resp.write_eof(), self.idle_timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            self.log(f"{res.name} response to {request.remote} abandoned after {record['sent']} bytes: "
                     f"{type(exc).__name__}")
            self.stats.abandoned += 1
            reset(request.transport)
            return resp
        record["seconds"] = time.perf_counter() - t0
        self.stats.cover(res.name, start, end)
        return resp

    async def _refresh(self) -> None:
        await self._versions.current()  # read the cache again first if its files changed on disk

    async def _lookup(self, raw_path: str, path: str):
        """The resource served at ``raw_path`` (this response's bytes, to its end) and whether its date validates;
        an :class:`HTTPRefusal` (404) if there is none."""
        await self._refresh()
        res = self.resources.get(raw_path)
        if res is None:
            raise HTTPRefusal(404, f"no such resource: {path[:200]}; this server has " + ", ".join(self.resources))
        return res, self._versions.dated(res)

    async def _final(self, res, a: int, b: int) -> None:
        """Return once bytes ``[a, b)`` of ``res`` may go out (a cache read from disk: at once; a cache still being
        written, :class:`lynxkv.serve.publish.PublishServer`: once they are final). Raising a ``ConnectionError``
        cuts the response off."""


class _OneLineLogger:
    """aiohttp's server logger, as one ``log`` line per event: a malformed request from a peer is that peer's
    error (it already got a 400), never a traceback in the server's output."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log

    def _line(self, msg, *args, exc_info=None, **kwargs) -> None:
        import sys

        text = str(msg) % args if args else str(msg)
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if exc is not None:
            text += f": {type(exc).__name__}: {' '.join(str(exc).split())}"
        self._log(text)

    exception = error = warning = info = _line

    def debug(self, *args, **kwargs) -> None:
        pass


class _Handler(RequestHandler):
    """aiohttp's connection handler, telling the connection table when request bytes arrive."""

    def data_received(self, data: bytes) -> None:
        if self._manager is not None:
            self._manager.owner._conns.received(self)
        super().data_received(data)


class _Server(web.Server):
    """aiohttp's low-level server with the connection accounting of :class:`CacheServer`."""

    def __init__(self, owner: CacheServer, handler, **kwargs):
        super().__init__(handler, **kwargs)
        self.owner = owner

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler, transport) -> None:
        self.owner._conns.admit(handler, transport)  # a refused one is reset once its handler has started
        super().connection_made(handler, transport)

    def connection_lost(self, handler, exc=None) -> None:
        self.owner._conns.drop(handler)
        super().connection_lost(handler, exc)
