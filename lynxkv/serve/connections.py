"""The bounds of ``lynxkv serve`` (:class:`Limits`) and the table of open connections that enforces them.

Connections. At most ``max_connections`` are open. At the cap a new connection closes one that has been idle
(no request in progress) for a second or more, to make room: one that has not completed a request yet if there
is one, else the longest idle; when every connection is busy, up to ``max(16, max_connections // 16)`` more
are admitted only to read their request and answer ``503 Service Unavailable`` (``Retry-After: 1``,
``Connection: close``); past that a new connection is reset. A refused client thus learns why, and the ones being
served keep their place.

Timeouts. A connection has ``header_timeout`` seconds (or ``idle_timeout`` if shorter) from connecting, and
``header_timeout`` from the first byte of each later request, to deliver a whole request header (a slowloris client that trickles a header byte by byte is closed
then); between requests a keep-alive connection may idle ``idle_timeout`` seconds; a response whose client takes
no bytes for ``idle_timeout`` seconds is abandoned and its connection reset (``SO_LINGER`` 0, so the kernel frees
what it still held for that client at once).

Bytes in flight. Per connection the server queues at most ``write_buffer`` bytes in its transport plus two 64 KiB
chunks (the point at which the transport pauses the response), and the kernel's send buffer is fixed at
``write_buffer`` (no autotuning for a client that stops reading). All connections together: once the bytes
queued in the server reach ``max_buffered``, a response whose client has not taken everything it was given waits
(up to ``idle_timeout``) until it has, before it gets another chunk; a client that keeps up never waits for
another one's backlog. So the queued bytes stay under ``max_buffered`` plus one chunk per connection, whatever
the clients do. The count is kept per connection when a response writes and summed again by the watchdog, so it
is never below what the transports hold.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import dataclass, field

from lynxkv.errors import InputError

EVICT_AFTER = 1.0  # seconds idle before a connection may be closed to make room for a new one
_MAX_WRITE_BUFFER = 1 << 30  # write_buffer is each connection's kernel send buffer too (a C int, doubled by Linux)


@dataclass(frozen=True)
class Limits:
    """What one ``lynxkv serve`` process grants its clients (see the module docstring)."""

    max_connections: int = 1024
    header_timeout: float = 10.0  # seconds to deliver a whole request header
    idle_timeout: float = 30.0  # seconds a keep-alive connection may idle, or a client may take no bytes
    write_buffer: int = 256 << 10  # bytes queued per connection (and its kernel send buffer)
    max_buffered: int = 64 << 20  # bytes queued in the server, all connections together

    def __post_init__(self) -> None:
        for name, low in (("max_connections", 1), ("header_timeout", 0.01), ("idle_timeout", 0.01),
                          ("write_buffer", 4096), ("max_buffered", 4096)):
            if not getattr(self, name) >= low:
                raise InputError(f"server limit {name}: expected at least {low}, got {getattr(self, name)!r}")
        if self.write_buffer > _MAX_WRITE_BUFFER:
            raise InputError(f"server limit write_buffer: expected at most {_MAX_WRITE_BUFFER} (1 GiB), got "
                             f"{self.write_buffer!r}")

    @property
    def extra_refusing(self) -> int:
        """Connections admitted over the cap only to be answered 503."""
        return max(16, self.max_connections // 16)


@dataclass
class ServerStats:
    requests: list = field(default_factory=list)  # dicts: resource, start, end, sent, tos, status, seconds
    served: int = 0  # requests answered (any status)
    refused: int = 0  # connections over the cap: answered 503, or reset when even the 503 allowance was full
    evicted: int = 0  # idle connections closed: to make room, after idle_timeout, or after header_timeout
    header_timeouts: int = 0  # of those, the ones that had not delivered a request header in time
    abandoned: int = 0  # responses whose client took no bytes for idle_timeout (connection reset)
    budget_waits: int = 0  # chunks that waited for the overall max_buffered budget
    peak_connections: int = 0
    peak_buffered: int = 0  # the most bytes queued in the server at once (an upper bound)
    _covered: dict = field(default_factory=lambda: {"anchor": [], "residual": [], "exact": []})

    def cover(self, resource: str, start: int, end: int) -> None:
        spans = sorted(self._covered[resource] + [(start, end)])
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self._covered[resource] = merged

    def uncover(self, resource: str) -> None:
        """Forget what went out of ``resource`` (its bytes changed)."""
        self._covered[resource] = []

    def covered(self, resource: str, size: int) -> bool:
        """Every byte of the resource has been sent at least once."""
        return self._covered[resource] == [(0, size)] or size == 0

    def counters(self) -> dict:
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


@dataclass
class Conn:
    since: float  # when it last became idle (or connected)
    deadline: float  # when it is closed unless a request is in progress
    active: int = 0  # requests in progress
    partial: bool = False  # bytes of a request have arrived, its header is not complete yet
    refusing: bool = False  # admitted over the cap: its request gets a 503
    buffered: int = 0  # bytes its transport held when last looked at
    requests: int = 0  # requests started on it
    gone: bool = False  # closed: no longer counted


def reset(transport) -> None:
    """Close with a reset: the kernel drops what it still holds for this client instead of sending it."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


class Connections:
    """The open connections, keyed by aiohttp's request handler; enforces :class:`Limits`."""

    def __init__(self, limits: Limits, stats: ServerStats):
        self.limits, self.stats = limits, stats
        self._conns: dict = {}  # handler -> Conn
        self.buffered = 0  # bytes queued in the server, the sum of Conn.buffered

    def __len__(self) -> int:
        return len(self._conns)

    def items(self):
        return list(self._conns.items())

    def get(self, handler) -> Conn | None:
        return self._conns.get(handler)

    def serving(self) -> int:
        return sum(1 for st in self._conns.values() if not st.refusing)

    # -- admission
    def admit(self, handler, transport) -> bool:
        """Admit a new connection, make room for it, or refuse it (False: it is reset next)."""
        now = time.monotonic()
        lim = self.limits
        refusing = False
        if self.serving() >= lim.max_connections:
            # the one that never completed a request goes first, then the longest idle; one that connected or
            # answered a moment ago is about to send its request and stays
            idle = [((st.requests > 0, st.since), h) for h, st in self._conns.items()
                    if st.active == 0 and not st.refusing and now - st.since >= EVICT_AFTER]
            if idle:
                _, oldest = min(idle, key=lambda x: x[0])
                self.stats.evicted += 1
                self.close(oldest)
            elif len(self._conns) - self.serving() < lim.extra_refusing:
                refusing = True
                self.stats.refused += 1
            else:
                self.stats.refused += 1
                # after aiohttp's handler has started (it is created after this call): a reset before that
                # would reach a handler that is already torn down
                asyncio.get_running_loop().call_later(0, reset, transport)
                return False
        transport.set_write_buffer_limits(high=lim.write_buffer)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, lim.write_buffer)
        timeout = min(lim.header_timeout, lim.idle_timeout, 5.0 if refusing else lim.header_timeout)
        self._conns[handler] = Conn(now, now + timeout, refusing=refusing)
        self.stats.peak_connections = max(self.stats.peak_connections, len(self._conns))
        return True

    def close(self, handler) -> None:
        self.drop(handler)
        handler.force_close()
        reset(handler.transport)

    def drop(self, handler) -> None:
        st = self._conns.pop(handler, None)
        if st is not None:
            self.buffered -= st.buffered
            st.buffered, st.gone = 0, True

    # -- the life of a request
    def received(self, handler) -> None:
        """Bytes arrived: the first of a new request starts its header deadline."""
        st = self._conns.get(handler)
        if st is not None and st.active == 0 and not st.partial:
            st.partial = True
            st.deadline = min(st.deadline, time.monotonic() + self.limits.header_timeout)

    def started(self, handler) -> Conn | None:
        st = self._conns.get(handler)
        if st is not None:
            st.active += 1
            st.requests += 1
            st.partial = False
        return st

    def finished(self, st: Conn) -> None:
        st.active -= 1
        st.since = time.monotonic()
        st.deadline = st.since + self.limits.idle_timeout

    def expire(self) -> None:
        """Close the connections past their deadline with no request in progress."""
        now = time.monotonic()
        for handler, st in self.items():
            if st.active == 0 and now > st.deadline:
                if not st.refusing:
                    self.stats.evicted += 1
                    self.stats.header_timeouts += st.partial or st.requests == 0
                self.close(handler)

    # -- bytes in flight
    def account(self, st: Conn, transport) -> None:
        if st.gone:
            return
        held = transport.get_write_buffer_size() if transport is not None else 0
        self.buffered += held - st.buffered
        st.buffered = held
        if self.buffered > self.stats.peak_buffered:
            self.stats.peak_buffered = self.buffered

    def recount(self) -> None:
        for handler, st in self.items():
            self.account(st, handler.transport)

    async def room(self, st: Conn, transport) -> None:
        """Wait until this connection may queue another chunk (the overall budget; see the module docstring);
        raise TimeoutError after ``idle_timeout`` without room."""
        self.account(st, transport)
        if st.buffered == 0 or self.buffered < self.limits.max_buffered:
            return
        self.stats.budget_waits += 1
        t_end = time.monotonic() + self.limits.idle_timeout
        delay = 0.005
        while True:
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 2)
            self.account(st, transport)
            if st.buffered == 0 or self.buffered < self.limits.max_buffered:
                return
            if time.monotonic() > t_end:
                raise asyncio.TimeoutError
