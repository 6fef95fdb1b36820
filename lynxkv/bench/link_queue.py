"""One emulated link for many loads: whole caches one at a time, in a policy's order.

Each load gets a *lane* (:meth:`LinkQueue.lane`), which it uses as its link (``open_progressive(..., link=lane)``).
A lane may use the shared :class:`~lynxkv.bench.emulated_link.EmulatedLink` only while it holds the *turn*: one
cache at a time, its anchor then its residual, so a cache finishes as early as the link allows instead of sharing
the rate with all the others. The turn passes when the holder has sent its whole cache (``size`` bytes, anchor and
residual) or is released (its load finished, failed or closed), to the lane the policy puts first among those
whose load has opened (:meth:`_Lane.join`) and whose cache is not done yet:

    fifo   the order the lanes were made in (arrival order)
    srf    smallest cache first (fewest bytes; ties in arrival order), not preempting the holder

Why ``srf``: with one link and the caches all waiting, sending them smallest first minimises the sum of their
completion times (the shortest-processing-time rule), and a request's time to N tokens is its full code's
arrival plus a part that does not depend on the order (the decode steps its drafts did not save), so it
minimises the mean time to N tokens as well. FIFO is the fair baseline: a large cache that arrived first
delays every smaller one behind it.

Why whole caches: a request's time to N tokens counts verified tokens. Sent anchors first, each residual would wait
for all the anchors (more than half the bytes); sent whole, a request's full code lands when the monolithic
baseline's does and its anchor a residual's transfer earlier (docs/speculative.md, "Batches"). ``lynxkv run``
uses the same lanes for the monolithic baseline and for Lynx.
"""

from __future__ import annotations

import threading

from lynxkv.errors import InputError
from lynxkv.bench.emulated_link import EmulatedLink

POLICIES = ("fifo", "srf")


class LinkQueue:
    """The shared link and the caches' turn (see the module docstring)."""

    def __init__(self, bandwidth: float | None, latency: float = 0.0, *, policy: str = "srf"):
        if policy not in POLICIES:
            raise InputError(f"link order: expected one of {', '.join(POLICIES)}, got {policy!r}")
        self.link = EmulatedLink(bandwidth, latency)
        self.policy = policy
        self._cond = threading.Condition()
        self._waiting: list[_Lane] = []
        self._holder: _Lane | None = None
        self._made = 0
        self.order: list[str] = []  # the names of the lanes, in the order they got the turn

    def lane(self, size: int | None = None, name: str = "") -> "_Lane":
        """A link for one load whose cache has ``size`` bytes, anchor and residual (None: unknown, sorted last by
        ``srf``)."""
        with self._cond:
            self._made += 1
            return _Lane(self, size, self._made, name or str(self._made))

    def _key(self, lane: "_Lane"):
        if self.policy == "fifo":
            return (lane.seq,)
        return (lane.size is None, lane.size or 0, lane.seq)

    def _join(self, lane: "_Lane") -> None:
        with self._cond:
            if not lane.released and lane not in self._waiting:
                self._waiting.append(lane)
            self._cond.notify_all()

    def _acquire(self, lane: "_Lane") -> None:
        """Block until ``lane`` holds the turn: no holder, and the policy puts it first among the lanes that have
        joined (opened their load) and not finished."""
        with self._cond:
            if self._holder is lane:
                return
            if lane not in self._waiting:
                self._waiting.append(lane)
            while True:
                if lane.released:
                    raise _Released()
                if self._holder is None and min(self._waiting, key=self._key) is lane:
                    self._holder = lane
                    self._waiting.remove(lane)
                    self.order.append(lane.name)
                    return
                self._cond.wait()

    def _release(self, lane: "_Lane") -> None:
        with self._cond:
            lane.released = True
            if lane in self._waiting:
                self._waiting.remove(lane)
            if self._holder is lane:
                self._holder = None
            self._cond.notify_all()


class _Released(Exception):
    pass


class _Lane:
    """One load's view of the shared link: the :class:`EmulatedLink` interface the transports use."""

    def __init__(self, queue: LinkQueue, size: int | None, seq: int, name: str):
        self.queue, self.size, self.seq, self.name = queue, size, seq, name
        self.sent = 0
        self.released = False

    @property
    def latency(self) -> float:
        return self.queue.link.latency

    @property
    def bandwidth(self) -> float | None:
        return self.queue.link.bandwidth

    def send(self, stream: int, nbytes: int) -> float:
        try:
            self.queue._acquire(self)
        except _Released:  # the load is over (closed, or its transfer failed): its bytes no longer matter
            return self.queue.link.send(stream, nbytes)
        delivered = self.queue.link.send(stream, nbytes)
        self.sent += nbytes
        if self.size is not None and self.sent >= self.size:
            self.release()
        return delivered

    def join(self) -> None:
        """The load has opened: from now on the policy counts this cache as waiting, whether or not its first
        block is ready yet (so a small cache that is a moment late still goes before a large one)."""
        self.queue._join(self)

    def release(self) -> None:
        """Give the turn up for good (the cache is complete, failed, or no longer wanted)."""
        self.queue._release(self)

    def report(self) -> dict:
        return self.queue.link.report()
