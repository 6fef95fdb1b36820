"""Saving a copy of a cache as it streams in (``lynxkv stream -o``).

A :class:`ReceivedCopy` is given to :func:`~lynxkv.stream.progressive.open_progressive` as its ``tee``: it keeps
every block the load receives, and writes the files only once the load has verified every page (:meth:`commit`):
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
from lynxkv.storage import (AtomicWriter, exists, read_all, record_location, remove, same_object, write_target,
                            writer_lock)
from lynxkv.stream.tier import check_cache_bytes, relocate_segments

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
        self._blocks: dict[str, list[tuple[int, bytes]]] = {"anchor": [], "residual": [], "exact": []}
        self._lock = threading.Lock()

    def tee(self, segment: str, offset: int, data: bytes) -> None:
        with self._lock:
            self._blocks[segment].append((offset, bytes(data)))

    def refuse_existing(self, path: str) -> None:
        if not self.force and exists(path):
            raise InputError(f"{path} already exists; pass --force to replace it")

    def _joined(self, *segments: str) -> bytearray:
        """The bytes of one object from the blocks of ``segments``, by offset (a single file arrives as the
        anchor stream alone, or as two streams over the two sections). The blocks are handed over: each is freed
        once copied, so that the copy and the blocks never add up to twice the object."""
        with self._lock:
            blocks = sorted(b for s in segments for b in self._blocks[s])
            for s in segments:
                self._blocks[s] = []
        out = bytearray(sum(len(data) for _, data in blocks))
        at = 0
        for i, (offset, data) in enumerate(blocks):
            if offset != at:
                raise LynxError(f"received blocks leave a gap at byte {at}; nothing was written")
            out[at:at + len(data)] = data
            at += len(data)
            blocks[i] = None  # the last reference to the block: freed now
        return out

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
        check_cache_bytes(anchor, external.get(c.SEGMENT_RESIDUAL), external.get(c.SEGMENT_EXACT))
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
        if moves:
            anchor = relocate_segments(anchor, moves)
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
                    with AtomicWriter(targets[kind], make_dirs=True) as w:
                        w.write(external.pop(kind))
                    written[name] = targets[kind]
                    if created[kind]:
                        published.append(targets[kind])
            with AtomicWriter(self.dest, make_dirs=True) as w:
                w.write(anchor)
        except BaseException:
            for f in published:  # a full disk: what no anchor names is not left behind
                if names_residual(self.dest, f) is False:
                    with contextlib.suppress(Exception):
                        remove(f)
            raise
        written["anchor"] = self.dest
        back = {kind: read_all(t) for kind, t in targets.items()}
        check_cache_bytes(read_all(self.dest), back.get(c.SEGMENT_RESIDUAL), back.get(c.SEGMENT_EXACT))
        for f in old:
            remove(f)
        return written
