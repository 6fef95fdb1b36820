"""Saving a copy of a cache as it streams in (``lynxkv stream -o``).

A :class:`ReceivedCopy` is given to :func:`~lynxkv.stream.progressive.open_progressive` as its ``tee``: it keeps
every block the load receives, and writes the files only once the load has verified every page (:meth:`commit`):
the residual first, then the anchor, each atomically, so an anchor never points at a missing residual.
"""

from __future__ import annotations

import threading

from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.storage import AtomicWriter, has_protocol, resolve_location


class ReceivedCopy:
    """Blocks of a load kept for writing to ``dest`` (the anchor) and ``residual_dest`` (default: the location
    the anchor records, next to ``dest``)."""

    def __init__(self, dest: str, residual_dest: str | None = None):
        self.dest, self.residual_dest = dest, residual_dest
        self._blocks: dict[str, list[tuple[int, bytes]]] = {"anchor": [], "residual": []}
        self._lock = threading.Lock()

    def tee(self, segment: str, offset: int, data: bytes) -> None:
        with self._lock:
            self._blocks[segment].append((offset, bytes(data)))

    def _joined(self, *segments: str) -> bytes:
        """The bytes of one object from the blocks of ``segments``, by offset (a single file arrives as the
        anchor stream alone, or as two streams over the two sections)."""
        out = bytearray()
        for offset, data in sorted(b for s in segments for b in self._blocks[s]):
            if offset != len(out):
                raise LynxError(f"received blocks leave a gap at byte {len(out)}; nothing was written")
            out += data
        return bytes(out)

    def commit(self, load, *, anchor_only: bool) -> dict:
        """Write what ``load`` (finished) received; ``anchor_only``: its residual failed. Returns what was
        written: ``{"anchor": path, "residual": path}``."""
        seg = load.header.segment(c.SEGMENT_RESIDUAL)
        if seg is not None and seg.placement == c.PLACEMENT_INLINE:
            if anchor_only:
                raise LynxError("the residual of this single-file cache failed; nothing was written")
            with AtomicWriter(self.dest, make_dirs=True) as w:
                w.write(self._joined("anchor", "residual"))
            return {"anchor": self.dest}
        written = {}
        if not anchor_only:
            rdest = self.residual_dest
            if rdest is None:
                if has_protocol(seg.location) or seg.location.startswith("/"):
                    raise InputError(f"the anchor records its residual at the absolute location {seg.location}; "
                                     "say where to write the copy with --residual-out")
                rdest = resolve_location(self.dest, seg.location)
            with AtomicWriter(rdest, make_dirs=True) as w:
                w.write(self._joined("residual"))
            written["residual"] = rdest
        with AtomicWriter(self.dest, make_dirs=True) as w:
            w.write(self._joined("anchor"))
        written["anchor"] = self.dest
        return written
