"""Replacing a two-file cache: the residual's fresh name, and what a killed writer of the same path left behind.

A writer that replaces the cache at ``x.lynx`` writes the new residual under a fresh name
(:func:`fresh_residual_name`) while the old anchor still names the old residual, renames the new anchor over
the old one last and only then removes the old residual. It holds the path's writer lock throughout
(:func:`lynxkv.storage.writer_lock`) and notes in it every file it is about to create or remove. A writer killed
part-way leaves its notes; the next writer of the path reads them first (:func:`settle_dead_writers`) and
removes that writer's temporaries and every residual it created or meant to remove that the anchor now in
place does not name. Nothing is found by a pattern of names, so a neighbour's file (``x.1a2b3c4d.lynx`` and its
residual beside ``x.lynx``) is never touched.
"""

from __future__ import annotations

import contextlib
import os

from lynxkv.cache.opened import open_cache
from lynxkv.errors import LynxError
from lynxkv.format import constants as c
from lynxkv.storage import (WriterLock, clean_stale_temps, exists, has_protocol, remove, resolve_location,
                            same_object)


def fresh_residual_name(rpath: str, cache_id: bytes, suffix: str = c.RESIDUAL_SUFFIX) -> str:
    """``x.lynxr`` -> ``x.<8 hex digits of the cache id>.lynxr`` (``suffix``: ``.lynxe`` for the exact segment's
    file; any other name gets the digits appended)."""
    tag = cache_id.hex()[:8]
    if rpath.endswith(suffix):
        return f"{rpath[:-len(suffix)]}.{tag}{suffix}"
    return f"{rpath}.{tag}"


def names_residual(anchor: str, name: str) -> bool | None:
    """Whether the cache at ``anchor`` keeps its residual (or its exact segment) in the file ``name``; None if it cannot tell (an anchor
    is there but does not open)."""
    if not exists(anchor):
        return False
    try:
        with open_cache(anchor) as cache:
            locations = [cache.info.residual_location, cache.info.exact_location]
    except LynxError:
        return None
    for loc in locations:  # the residual's file, or the exact segment's
        if loc is None:
            continue
        try:
            if same_object(resolve_location(anchor, loc, allow=[name]), name):
                return True
        except LynxError:
            continue  # it names a place that is not ``name``
    return False


def settle_dead_writers(lock: WriterLock, anchor: str) -> list[str]:
    """Remove what the killed writers of ``anchor`` noted in ``lock`` (its ``left``): their temporaries of every
    file they noted, and each residual they created or meant to remove that the cache now at ``anchor`` does not
    name. Returns the names removed (temporaries by their file name)."""
    removed: list[str] = []
    dead = {n.pid for n in lock.left}
    for n in lock.left:
        if has_protocol(n.name):
            continue
        removed += clean_stale_temps(n.name, dead_pids=dead)
        if n.kind in ("new", "old") and not same_object(n.name, anchor) and os.path.isfile(n.name) \
                and names_residual(anchor, n.name) is False:
            with contextlib.suppress(LynxError):
                remove(n.name)
                removed.append(n.name)
    lock.settled()
    return removed
