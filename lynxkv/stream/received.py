"""Saving a copy of a cache as it streams in (``lynxkv stream -o``).

A :class:`ReceivedCopy` is given to :func:`~lynxkv.stream.progressive.open_progressive` as its ``tee``: it keeps
every block the load receives, and writes the files only once the load has verified every page (:meth:`commit`):
the residual first, then the anchor, each atomically, so an anchor never points at a missing residual; then it
reads both back and checks every page of every segment. A residual written for an anchor that then fails to
be written (a full disk) is removed again.

Where it writes: ``dest``, and the residual at ``residual_dest`` or else at the relative location the anchor
records, which must stay inside ``dest``'s directory (:func:`lynxkv.storage.write_target`). An existing file is
replaced only with ``force``.
"""

from __future__ import annotations

import contextlib
import threading

from lynxkv.cache import residual_file_of
from lynxkv.cache.replace import fresh_residual_name, names_residual, settle_dead_writers
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.storage import (AtomicWriter, exists, read_all, record_location, remove, same_object, write_target,
                            writer_lock)
from lynxkv.stream.tier import check_cache_bytes, relocate_residual


class ReceivedCopy:
    """Blocks of a load kept for writing to ``dest`` (the anchor) and ``residual_dest`` (default: the location
    the anchor records, next to ``dest``)."""

    def __init__(self, dest: str, residual_dest: str | None = None, *, force: bool = False):
        self.dest, self.residual_dest = dest, residual_dest
        self.force = force
        self.refuse_existing(dest)
        if residual_dest is not None:
            self.refuse_existing(residual_dest)
        self._blocks: dict[str, list[tuple[int, bytes]]] = {"anchor": [], "residual": []}
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
        seg = load.header.segment(c.SEGMENT_RESIDUAL)
        if seg is not None and seg.placement == c.PLACEMENT_INLINE:
            if anchor_only:
                raise LynxError("the residual of this single-file cache failed; nothing was written")
            data = self._joined("anchor", "residual")
            check_cache_bytes(data)
            old = residual_file_of(self.dest) if self.force else None  # a replaced two-file copy's residual
            if old is not None:
                lock.note("old", old)
            with AtomicWriter(self.dest, make_dirs=True) as w:
                w.write(data)
            check_cache_bytes(read_all(self.dest))
            if old is not None:
                remove(old)
            return {"anchor": self.dest}
        written = {}
        anchor = self._joined("anchor")
        residual = None if anchor_only else self._joined("residual")
        check_cache_bytes(anchor, residual)
        old = residual_file_of(self.dest) if self.force else None  # the replaced copy's residual, removed last
        created = False
        if residual is not None:
            rdest = self.residual_dest or write_target(self.dest, seg.location)
            self.refuse_existing(rdest)
            if exists(rdest):
                # Replacing (--force): the new residual under a fresh name and the anchor pointing at it, so a
                # reader of dest sees the old copy or the new one, never a mix; the old residual goes last.
                old = old or rdest
                rdest = fresh_residual_name(rdest, load.header.cache_id)
                anchor = relocate_residual(anchor, record_location(self.dest, rdest))
            created = not exists(rdest)
            lock.note("new" if created else "tmp", rdest)  # every note before the first file
        if old is not None and not same_object(old, rdest if residual is not None else self.dest):
            lock.note("old", old)
        if residual is not None:
            with AtomicWriter(rdest, make_dirs=True) as w:
                w.write(residual)
            written["residual"] = rdest
        try:
            with AtomicWriter(self.dest, make_dirs=True) as w:
                w.write(anchor)
        except BaseException:
            if created and names_residual(self.dest, written["residual"]) is False:  # a full disk: no anchor
                with contextlib.suppress(Exception):                              # names it, not left behind
                    remove(written["residual"])
            raise
        written["anchor"] = self.dest
        check_cache_bytes(read_all(self.dest), None if residual is None else read_all(written["residual"]))
        if old is not None and not same_object(old, written.get("residual", self.dest)):
            remove(old)
        return written
