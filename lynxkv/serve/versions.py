"""The version of the cache that ``lynxkv serve`` answers from, read again when its files change on disk.

Reloading. Each request first looks at the files the current version was read from (one ``stat`` each). When
one has changed (a new file renamed over it, or rewritten), the cache is read and checked again exactly as at
start-up (same names, same trust rule, every CRC), in a worker thread, once for all the requests that arrive
meanwhile (they wait for it); the new version answers them and every later request. If the files now there do not
make a whole cache (an anchor renamed over before its residual, a file half written, a location the trust rule
refuses), the version read before goes on being served, the reason is logged, and the next try is a second later
at the soonest. A cache read from a URL is never read again.

One version per response. A response is served from the version it was validated against: its resource's bytes
stay in memory until that response ends, whatever is reloaded meanwhile, so no response is a splice of two
versions. A resource's ETag is a digest of its bytes, so it changes whenever they do.

Dates. ``Last-Modified`` is the file's mtime in whole seconds, which two versions written within one second
share. A version's date is sent, and an ``If-Range`` date honoured, only once the server has seen the file
unchanged on disk at a time after its mtime's second was over (so no other version was written in that second
after it, and none before it was dated by this rule), and never for a version that replaced one with the same
date but other bytes while this server ran (a copy that kept an older mtime). A relocated anchor (its header
rewritten by the server) has no date. Until then a client validates with the ETag, which RFC 9110 clients prefer
anyway.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from typing import Callable

from lynxkv.serve.resources import Resource, ServedCache

RETRY_AFTER = 1.0  # seconds between two tries to read a cache whose files on disk do not make a whole one


class Versions:
    """The current :class:`ServedCache` of a server (see the module docstring); used on the event loop only."""

    def __init__(self, served: ServedCache, *, log: Callable[[str], None],
                 swapped: Callable[[ServedCache, ServedCache], None] = lambda old, new: None):
        self.served = served
        self._log, self._swapped = log, swapped
        self._index(served)
        self._reloading: asyncio.Future | None = None
        self._retry_at = 0.0
        self._failure = ""  # why the last try to read the files again failed (logged once)
        self._dated: set[str] = set()  # resource names whose date validates (see the module docstring)
        self._undated: set[str] = set()  # names whose date never validates in this version

    def _index(self, served: ServedCache) -> None:
        self.by_path = {"/" + urllib.parse.quote(r.path): r for r in served.resources()}

    def dated(self, res: Resource) -> bool:
        """Whether ``res``'s ``Last-Modified`` is sent and an ``If-Range`` date may select a range of it."""
        return res.name in self._dated and res is getattr(self.served, res.name)

    async def current(self) -> ServedCache:
        """The version the next response is served from: read again first if its files changed."""
        if self._reloading is None:
            now = time.time()  # before the stat: the files are unchanged at least until now
            if self.served.on_disk():
                self._date(now)
                return self.served
            if time.monotonic() < self._retry_at:
                return self.served
            self._reloading = asyncio.ensure_future(self._reload())
        await asyncio.shield(self._reloading)
        return self.served

    def _date(self, now: float) -> None:
        for r in self.served.resources():
            if r.modified is not None and r.name not in self._undated and now >= r.modified + 1:
                self._dated.add(r.name)

    async def _reload(self) -> None:
        try:
            new = await asyncio.to_thread(self.served.reload)
        except Exception as exc:  # noqa: BLE001 - whatever the files now are, the checked version goes on
            self._retry_at = time.monotonic() + RETRY_AFTER
            if str(exc) != self._failure:
                self._failure = str(exc)
                self._log(f"the cache changed on disk and is not served until it reads whole again ({exc}); still "
                          "serving the version read before")
        else:
            old = {r.name: r for r in self.served.resources()}
            self._undated = {r.name for r in new.resources() if r.name in old and old[r.name].modified == r.modified
                             and (old[r.name].etag != r.etag or r.name in self._undated)}
            self._dated, self._failure = set(), ""
            previous, self.served = self.served, new
            self._index(new)
            self._swapped(previous, new)
        finally:
            self._reloading = None
