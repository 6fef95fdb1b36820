"""An emulated network link for benchmarks and tests: one token bucket shared by the anchor, residual and exact
streams, strict priority. It delays the bytes a transport charges to it (:class:`lynxkv.stream.link.Link`) and
tells the reader nothing: the engine's ETA comes from the bytes it sees arrive, as on a real link.

Model. The link serialises bytes at ``bandwidth`` bytes/s and delivers each byte ``latency`` seconds after it was
serialised (a pipe: latency adds once per stream, not once per block). The streams draw from ONE token bucket:

    tokens(t) = min(burst, tokens(t0) + bandwidth * (t - t0))      # refill, capped at `burst` bytes
    send(n):  tokens -= n;  sleep until tokens >= 0                  # debt model: exact long-run rate

The bytes never arrive sooner than on an ideal link that started with the first send: the bucket starts empty, and
credit only accrues at the link's rate. The cap ``burst`` (50 ms of link time by default) is the room a real
receiver has in its socket buffer: while a transfer goes on, the link keeps moving bytes when the receiving thread
is late, so neither a late wake-up nor the hand-over from one block's sender to the next loses link time. After an
idle spell of 20 ms or more (no send waiting), the bucket starts empty again, so a new transfer gets no credit for
the idle time. Strict priority: a residual block is granted only while no anchor block is
waiting, so the residual gets exactly what the anchor leaves (the paper's rule; a stalled anchor source leaves
the link to the residual), and an exact block only while neither is waiting. Blocks are granted whole, so a grant delays the anchor by at most one residual block:
callers send in quanta of ``quantum`` bytes.

Per stream the link records bytes and the first-grant / last-delivery times, from which the measured rates are
reported.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from lynxkv.stream.link import STREAMS, TokenBucket
from lynxkv.stream.units import parse_bandwidth, parse_duration


@dataclass
class StreamStats:
    bytes: int = 0
    first_s: float | None = None  # when its first byte started on the wire (seconds since the link was made)
    last_s: float | None = None  # when its last byte was delivered

    @property
    def rate(self) -> float | None:
        """Measured bytes/s over the stream's own active interval."""
        if self.first_s is None or self.last_s is None or self.last_s <= self.first_s:
            return None
        return self.bytes / (self.last_s - self.first_s)


class EmulatedLink:
    """A shared, rate-limited, strictly prioritised link (``bandwidth=None``: priority only, no rate limit)."""

    def __init__(self, bandwidth: float | None, latency: float = 0.0, *, quantum: int = 256 * 1024,
                 burst: int | None = None):
        self.bandwidth = bandwidth
        self.latency = latency
        self.quantum = quantum
        # 50 ms of link time (a socket buffer's worth: 1.25 MB at 200 Mbit/s): a reader's thread woken late while
        # the runner's forward holds both cores (up to about 25 ms measured) or the hand-over between two blocks'
        # senders (a few ms, 3-4% of the rate in all at 200 Mbit/s) costs no link time (docs/tiers.md).
        self.burst = burst if burst is not None else int((bandwidth or 0) * 0.050)
        # A link with no send waiting for this long was idle, not between two blocks of one transfer.
        self.idle_restart_s = 0.020
        self.t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._waiting = [0] * len(STREAMS)  # blocks waiting for a grant, per stream
        self._bucket = TokenBucket(bandwidth, self.burst) if bandwidth else None
        self._idle_since: float | None = None  # perf_counter when the last send ended with none waiting
        self.stats = tuple(StreamStats() for _ in STREAMS)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def send(self, stream: int, nbytes: int) -> float:
        """Block until ``nbytes`` of ``stream`` have been serialised; return the perf_counter time at which they
        are delivered (serialisation end + latency).

        The whole send counts as waiting demand of its stream from the first quantum to the last, so a lower
        priority cannot slip in between the quanta of one send; large sends are still charged quantum by
        quantum so the bucket never runs far into debt."""
        with self._cond:
            self._waiting[stream] += 1
            while any(self._waiting[s] for s in range(stream)):  # a higher-priority send is waiting
                self._cond.wait()
            st = self.stats[stream]
            if st.first_s is None:
                st.first_s = self.now()
        try:
            remaining = max(nbytes, 0)
            while remaining > 0:
                n = min(remaining, self.quantum)
                with self._cond:  # a higher priority that arrived meanwhile goes first, from the next quantum on
                    while any(self._waiting[s] for s in range(stream)):
                        self._cond.wait()
                self._charge(n)
                remaining -= n
                with self._cond:
                    st.bytes += n
        finally:
            end = time.perf_counter()
            with self._cond:
                self._waiting[stream] -= 1
                if nbytes > 0:
                    st.last_s = end + self.latency - self.t0
                if not any(self._waiting):
                    self._idle_since = end
                self._cond.notify_all()
        return end + self.latency

    @contextmanager
    def hold(self, stream: int):
        """Count ``stream`` as having demand for the whole ``with`` block (a sender with a whole segment queued),
        so lower priorities wait even between its sends."""
        with self._cond:
            self._waiting[stream] += 1
        try:
            yield self
        finally:
            with self._cond:
                self._waiting[stream] -= 1
                self._cond.notify_all()

    def _charge(self, n: int) -> None:
        """Take ``n`` tokens from the shared bucket and sleep off any debt (outside the lock)."""
        if self.bandwidth is None:
            return
        with self._cond:
            now = time.perf_counter()
            idle = self._idle_since is not None and now - self._idle_since >= self.idle_restart_s
            wait = self._bucket.debit(n, now, restart=idle)
            self._idle_since = None
        if wait > 0:
            time.sleep(wait)

    def report(self) -> dict:
        """Measured per-stream and total figures (bytes, seconds since the link was made, bytes/s)."""
        firsts = [s.first_s for s in self.stats if s.first_s is not None]
        lasts = [s.last_s for s in self.stats if s.last_s is not None]
        total = sum(s.bytes for s in self.stats)
        span = (max(lasts) - min(firsts)) if firsts and lasts else None
        out = {"bandwidth": self.bandwidth, "latency_s": self.latency}
        for name, s in zip(STREAMS, self.stats):
            out[name] = {"bytes": s.bytes, "first_s": s.first_s, "last_s": s.last_s, "rate": s.rate}
        out["total"] = {"bytes": total, "span_s": span, "rate": (total / span) if span else None}
        return out


def link_at(bandwidth: str | float | None, latency: str | float | None = None) -> EmulatedLink | None:
    """An :class:`EmulatedLink` at ``bandwidth`` (``"1Gbps"``, or bytes/s) with one-way ``latency`` (``"2ms"``), or
    None when neither is given (no link between the load and its source)."""
    rate, delay = parse_bandwidth(bandwidth), parse_duration(latency)
    return EmulatedLink(rate, delay) if rate is not None or delay > 0 else None
