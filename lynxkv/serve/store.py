"""A directory of caches over HTTP: :class:`StoreServer`, what a prefill instance serves its finished caches from.

``GET /<name>.lynx`` is the anchor of the cache ``<directory>/<name>.lynx``, and its residual is at the location its
anchor records (``<name>.lynxr`` beside it), as with :class:`~lynxkv.serve.server.CacheServer`, whose ranges,
priorities (anchor ahead of residual), DSCP marks and connection bounds it shares. A cache is read and checked when
first asked for and kept (at most ``keep`` of them, the least recently used dropped first); one whose files change
on disk is read again. Names are plain file names (letters, digits, ``.``, ``_``, ``-``; no leading dot, at most 128
characters): nothing outside the directory is ever read, and its residual is followed only inside it.
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.parse
from collections import OrderedDict
from typing import Callable

from lynxkv.errors import LynxError

from lynxkv.serve.ranges import HTTPRefusal
from lynxkv.serve.resources import load_served_cache
from lynxkv.serve.server import CacheServer
from lynxkv.serve.versions import Versions

ANCHOR_SUFFIX = ".lynx"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class StoreServer(CacheServer):
    """Serves every cache in ``directory`` (see the module docstring); the options are
    :class:`~lynxkv.serve.server.CacheServer`'s."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 64, log: Callable[[str], None] | None = None,
                 **options):
        self.directory = os.path.realpath(os.fspath(directory))
        if not os.path.isdir(self.directory):
            raise LynxError(f"{directory}: not a directory")
        self.keep = max(1, int(keep))
        self._caches: OrderedDict[str, Versions] = OrderedDict()  # anchor file name -> its current version
        super().__init__(None, log=log, **options)

    @property
    def url(self) -> str:
        """Where the caches are: ``url + "/" + name + ".lynx"``."""
        return self.base_url

    @property
    def resources(self) -> dict:
        return {p: r for v in self._caches.values() for p, r in v.by_path.items()}

    def describe(self) -> dict:
        return {"url": self.url, "host": self.host, "port": self.port, "directory": self.directory,
                "caches": sorted(self._caches)}

    async def _refresh(self) -> None:
        return None

    async def _lookup(self, raw_path: str, path: str):
        name = urllib.parse.unquote(raw_path.lstrip("/"))
        if not _NAME.fullmatch(name):
            raise HTTPRefusal(404, f"no such resource: {path[:200]}")
        anchor = name if name.endswith(ANCHOR_SUFFIX) else None
        if anchor is None:  # a side segment: the cache whose stem it starts with
            stem = name.split(".", 1)[0]
            anchor = stem + ANCHOR_SUFFIX
        versions = await self._versions_of(anchor, path)
        await versions.current()
        res = versions.by_path.get("/" + urllib.parse.quote(name))
        if res is None:
            raise HTTPRefusal(404, f"no such resource: {path[:200]}")
        return res, versions.dated(res)

    async def _versions_of(self, anchor: str, path: str) -> Versions:
        versions = self._caches.get(anchor)
        if versions is not None:
            self._caches.move_to_end(anchor)
            return versions
        where = os.path.join(self.directory, anchor)
        if not os.path.isfile(where):
            raise HTTPRefusal(404, f"no such resource: {path[:200]}")
        try:
            served = await asyncio.to_thread(load_served_cache, where)
        except (LynxError, OSError) as exc:
            self.log(f"{anchor}: not served: {exc}")
            raise HTTPRefusal(404, f"no such resource: {path[:200]} (it does not read whole)") from None
        versions = self._caches.get(anchor) or Versions(served, log=self.log)
        self._caches[anchor] = versions
        while len(self._caches) > self.keep:
            self._caches.popitem(last=False)
        return versions
