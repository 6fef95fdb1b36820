"""Saving a copy of a cache as it streams in (``lynxkv stream -o``).

A :class:`ReceivedCopy` is given to :func:`~lynxkv.stream.progressive.open_progressive` as its ``tee``: it keeps
every block the load receives in a scratch file on disk (one per segment, unnamed, gone when closed: memory holds
a block, not the cache), and writes the files only once the load has verified every page (:meth:`commit`):
the residual first, then the exact segment (when the load read it), then the anchor, each atomically,
so an anchor never points at a missing side file; then it reads them back and checks every page of every segment.
A side file written for an anchor that then fails to be written (a full disk) is removed again.

Where it writes: ``dest``, the residual at ``residual_dest`` and the exact segment at ``exact_dest``, or else each
at the relative location the anchor records, which must stay inside ``dest``'s directory
(:func:`lynxkv.storage.write_target`); the copy's anchor records where its side files went. An existing file is
replaced only with ``force``.
"""

from __future__ import annotations

import contextlib
import threading

from lynxkv.cache import exact_file_of, residual_file_of
from lynxkv.cache.replace import fresh_residual_name, names_residual, settle_dead_writers
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.storage import (AtomicWriter, exists, open_source, record_location, remove, same_object, write_target,
                            writer_lock)
from lynxkv.storage.atomic import SpillFile
from lynxkv.storage.sources import FileObjSource
from lynxkv.stream.tier import check_cache_sources, relocate_segments

_SIDES = ((c.SEGMENT_RESIDUAL, "residual", c.RESIDUAL_SUFFIX), (c.SEGMENT_EXACT, "exact", c.EXACT_SUFFIX))


class ReceivedCopy:
    """Blocks of a load kept for writing to ``dest`` (the anchor), ``residual_dest`` and ``exact_dest`` (default:
    the locations the anchor records, next to ``dest``)."""

    def __init__(self, dest: str, residual_dest: str | None = None, *, force: bool = False,
                 exact_dest: str | None = None):
        self.dest, self.residual_dest, self.exact_dest = dest, residual_dest, exact_dest
        self.force = force
        self.refuse_existing(dest)
        for side in (residual_dest, exact_dest):
            if side is not None:
                self.refuse_existing(side)
        self._spills: dict[str, SpillFile] = {}  # segment -> the bytes received, at their offsets
        self._spans: dict[str, list[tuple[int, int]]] = {"anchor": [], "residual": [], "exact": []}
        self._lock = threading.Lock()

    def tee(self, segment: str, offset: int, data: bytes) -> None:
        with self._lock:
            spill = self._spills.get(segment)
            if spill is None:
                spill = self._spills[segment] = SpillFile()
            spill.fill(offset, data)
            self._spans[segment].append((offset, len(data)))

    def close(self) -> None:
        """Let the scratch files go (what :meth:`commit` did not write is dropped)."""
        with self._lock:
            spills, self._spills = list(self._spills.values()), {}
        for spill in spills:
            spill.close()

    def refuse_existing(self, path: str) -> None:
        if not self.force and exists(path):
            raise InputError(f"{path} already exists; pass --force to replace it")

    def _joined(self, *segments: str) -> tuple[SpillFile, int]:
        """The scratch file holding one object, and its size, from the blocks of ``segments`` (a single file
        arrives as the anchor stream alone, or as two streams over the two sections: the second's blocks are
        copied into the first's file, a block at a time); refused if the blocks leave a gap."""
        with self._lock:
            spans = sorted(s for seg in segments for s in self._spans[seg])
            spills = [self._spills[seg] for seg in segments if seg in self._spills]
        at = 0
        for offset, n in spans:
            if offset != at:
                raise LynxError(f"received blocks leave a gap at byte {at}; nothing was written")
            at += n
        if not spills:
            raise LynxError("no bytes of this object were received; nothing was written")
        head = spills[0]
        for other in spills[1:]:
            seg = next(s for s in segments if self._spills.get(s) is other)
            for offset, n in self._spans[seg]:
                head.fill(offset, other.read(offset, n))
        return head, at

    @staticmethod
    def _source(spill: SpillFile, size: int, name: str) -> FileObjSource:
        return FileObjSource(spill.file, name, size)

    def commit(self, load, *, anchor_only: bool) -> dict:
        """Write what ``load`` (finished) received; ``anchor_only``: its residual failed. Returns what was
        written: ``{"anchor": path, "residual": path}``. Writers of one ``dest`` take turns
        (:func:`lynxkv.storage.writer_lock`), and each first removes what a killed one left
        (:func:`lynxkv.cache.replace.settle_dead_writers`)."""
        with writer_lock(self.dest, make_dirs=True) as lock:
            settle_dead_writers(lock, self.dest)
            return self._commit(lock, load, anchor_only=anchor_only)

    def _commit(self, lock, load, *, anchor_only: bool) -> dict:
        h = load.header
        exact_in = h.segment(c.SEGMENT_EXACT) is not None and load.exact.done() and load.exact.exception() is None
        inline, external = ["anchor"], {}
        for kind, name, _ in _SIDES:
            seg = h.segment(kind)
            got = exact_in if kind == c.SEGMENT_EXACT else not anchor_only
            if seg is not None and seg.placement == c.PLACEMENT_INLINE:
                if not got:
                    raise LynxError(f"the {name} segment of this single-file cache was not received; nothing was "
                                    "written")
                inline.append(name)
            elif seg is not None and got:
                external[kind] = self._joined(name)
        anchor = self._joined(*inline)
        check_cache_sources(self._source(*anchor, "anchor"),
                            *(self._source(*external[k], n) if k in external else None for k, n, _ in _SIDES))
        # the replaced copy's side files, removed last
        old_of = {c.SEGMENT_RESIDUAL: residual_file_of(self.dest) if self.force else None,
                  c.SEGMENT_EXACT: exact_file_of(self.dest) if self.force else None}
        targets, moves = {}, {}
        for kind, name, suffix in _SIDES:
            if kind not in external:
                continue
            seg = h.segment(kind)
            target = (self.residual_dest if kind == c.SEGMENT_RESIDUAL else self.exact_dest) \
                or write_target(self.dest, seg.location, what=name)
            self.refuse_existing(target)
            if exists(target):
                # Replacing (--force): the new side file under a fresh name and the anchor pointing at it, so a
                # reader of dest sees the old copy or the new one, never a mix; the old file goes last.
                old_of[kind] = old_of[kind] or target
                target = fresh_residual_name(target, h.cache_id, suffix)
            location = record_location(self.dest, target)
            if location != seg.location:
                moves[kind] = location
            targets[kind] = target
        # a relocated anchor is rebuilt in memory (its header's length changes); otherwise it is copied from disk
        anchor_parts = [relocate_segments(b"".join(anchor[0].chunks(anchor[1])), moves)] if moves \
            else anchor[0].chunks(anchor[1])
        created = {kind: not exists(t) for kind, t in targets.items()}
        for kind, t in targets.items():  # every note before the first file
            lock.note("new" if created[kind] else "tmp", t)
        keep = [self.dest, *targets.values()]
        old = [f for f in old_of.values() if f is not None and not any(same_object(f, k) for k in keep)]
        for f in old:
            lock.note("old", f)
        written, published = {}, []
        try:
            for kind, name, _ in _SIDES:  # the side files first: an anchor never names a missing one
                if kind in targets:
                    spill, size = external.pop(kind)
                    with AtomicWriter(targets[kind], make_dirs=True) as w:
                        for part in spill.chunks(size):
                            w.write(part)
                    written[name] = targets[kind]
                    if created[kind]:
                        published.append(targets[kind])
            with AtomicWriter(self.dest, make_dirs=True) as w:
                for part in anchor_parts:
                    w.write(part)
        except BaseException:
            for f in published:  # a full disk: what no anchor names is not left behind
                if names_residual(self.dest, f) is False:
                    with contextlib.suppress(Exception):
                        remove(f)
            raise
        written["anchor"] = self.dest
        back = [_reader(self.dest), *(_reader(targets[k]) if k in targets else None for k, _, _ in _SIDES)]
        try:
            check_cache_sources(*back)  # read back page by page
        finally:
            for src in back:
                if src is not None:
                    src.close()
        for f in old:
            remove(f)
        return written


def _reader(where: str):
    """A source for reading a written file back page by page: a local file through plain reads (a mapping would
    keep every page read in this process's resident memory), anything else as the storage layer opens it."""
    import os

    if "://" not in where and os.path.isfile(where):
        return FileObjSource(open(where, "rb"), where, owns=True)
    return open_source(where)
