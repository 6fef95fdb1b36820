"""A byte source fed by an ordered block stream: the bridge between transports and the format's readers.

The format reads through ``src.read(offset, length)`` on an object with ``size``. A :class:`StreamBuffer` offers
exactly that over bytes that are still arriving: ``read`` blocks until the range is in, then returns it. The
reader calls :meth:`release` once it has used everything below an offset; the buffer drops those blocks, and the
feeding side waits while more than ``cap`` bytes are held beyond what was released (unless a reader is waiting
for bytes further on), so memory stays bounded however large the segment is.
"""

from __future__ import annotations

import threading
from collections import deque

from lynxkv.errors import FormatError, LynxError


class StreamClosed(LynxError):
    """The load was closed while a read was waiting."""


class StreamBuffer:
    def __init__(self, size: int, name: str, *, base: int = 0, cap: int = 16 << 20):
        self.size = size  # absolute size of the object the offsets refer to
        self.name = name
        self.base = base
        self.cap = cap
        self.received = 0  # bytes fed so far
        self._blocks: deque[tuple[int, bytes]] = deque()
        self._have = base  # end offset of the bytes received
        self._released = base
        self._marks: dict[str, int] = {}  # per reader: released up to here (a single file has two readers)
        self._want = base
        self._error: BaseException | None = None
        self._finished = False
        self._cond = threading.Condition()

    # -- feeding side
    def feed(self, offset: int, data: bytes) -> None:
        with self._cond:
            if offset != self._have:
                raise FormatError(f"{self.name}: block at byte {offset} arrived out of order (expected {self._have})",
                                  where=self.name)
            while (self._have - self._released > self.cap and self._want <= self._have
                   and self._error is None):
                self._cond.wait(0.5)
            if self._error is not None:
                raise self._error
            self._blocks.append((offset, data))
            self._have += len(data)
            self.received += len(data)
            self._cond.notify_all()

    def register(self, reader: str, at: int) -> None:
        """Add a reader that will read from ``at`` on (bytes below stay until the others release them)."""
        with self._cond:
            self._marks[reader] = at

    def unregister(self, reader: str) -> None:
        with self._cond:
            self._marks.pop(reader, None)
            if self._marks:
                self._released = max(self._released, min(self._marks.values()))
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    # -- reading side (the format's ByteSource protocol)
    def read(self, offset: int, length: int) -> bytes:
        end = min(offset + max(length, 0), self.size)
        with self._cond:
            if offset < self._released:
                raise FormatError(f"{self.name}: byte {offset} was already released (reads must move forward)",
                                  where=self.name)
            self._want = max(self._want, end)
            while self._have < end:
                if self._error is not None:
                    raise self._error
                if self._finished:
                    break  # the object ended early: return what there is; the format reports the truncation
                self._cond.notify_all()
                self._cond.wait(0.5)
            parts = []
            for boff, data in self._blocks:
                if boff >= end:
                    break
                if boff + len(data) <= offset:
                    continue
                parts.append(memoryview(data)[max(0, offset - boff):end - boff])
            return b"".join(parts)  # one copy of the range (the blocks are dropped on release, not kept by views)

    def release(self, upto: int, reader: str = "main") -> None:
        """``reader`` is done with everything below ``upto``; bytes go once every registered reader is done
        with them (the anchor and the residual parser share the one stream of a single-file cache)."""
        with self._cond:
            self._marks[reader] = max(self._marks.get(reader, self.base), upto)
            self._released = max(self._released, min(self._marks.values()))
            while self._blocks and self._blocks[0][0] + len(self._blocks[0][1]) <= self._released:
                self._blocks.popleft()
            self._cond.notify_all()


class InPlaceBuffer:
    """A segment already in hand: a memory-mapped local file (:class:`lynxkv.storage.FileSource`), read where it
    lies. The reading side of :class:`StreamBuffer` with nothing to wait for and nothing held: ``view`` hands out
    views of the mapping (what the page reader reads pages through, so the pages are never copied), ``read`` copies
    (headers, indexes); ``release`` has nothing to drop. Bytes count as arrived when the reader first reaches them:
    ``on_read(offset, data)`` is told of the part of each read beyond the furthest byte read before.

    As with ``open_cache`` (and safetensors), the file must not be truncated while it is mapped: the kernel ends a
    process that reads a mapped page past the file's new end (SIGBUS). lynxkv replaces files atomically (a new
    file renamed over the old one), which leaves a mapping of the old file intact."""

    def __init__(self, source, name: str, *, base: int = 0, on_read=None):
        self.source = source
        self.size = source.size
        self.name = name
        self.base = base
        self._reached = base  # the furthest byte read so far
        self._on_read = on_read
        self._error: BaseException | None = None

    def _arrived(self, offset: int, data) -> None:
        if self._error is not None:
            raise self._error
        new = offset + len(data) - max(offset, self._reached)
        if new > 0:
            self._reached = offset + len(data)
            if self._on_read is not None:
                self._on_read(self._reached - new, memoryview(data)[len(data) - new:])

    def read(self, offset: int, length: int) -> bytes:
        data = self.source.read(offset, max(length, 0))
        self._arrived(offset, data)
        return data

    def view(self, offset: int, length: int) -> memoryview:
        data = self.source.view(offset, max(length, 0))
        self._arrived(offset, data)
        return data

    def register(self, reader: str, at: int) -> None:
        pass

    def unregister(self, reader: str) -> None:
        pass

    def release(self, upto: int, reader: str = "main") -> None:
        pass

    def drop(self, offset: int, length: int) -> None:
        """Bytes no longer needed in memory: the mapping's pages leave the RSS (:meth:`FileSource.drop`)."""
        drop = getattr(self.source, "drop", None)
        if drop is not None:
            drop(offset, length)

    def finish(self) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        """Later reads raise ``exc`` (the load was closed, or gave up on this segment)."""
        if self._error is None:
            self._error = exc
