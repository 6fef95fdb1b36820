"""The streams of a load, in priority order, and what a transport asks of the link its bytes cross.

A transport charges every block it moves to an optional :class:`Link` (``send`` blocks for the block's time on
the link and returns when it is delivered); the reader never asks a link for its rate. :class:`TokenBucket` is the
rate arithmetic a link or a server's egress shapes bytes with (``lynxkv serve --bandwidth``). An emulated link for
benchmarks and tests is :class:`lynxkv.bench.emulated_link.EmulatedLink`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

ANCHOR, RESIDUAL, EXACT = 0, 1, 2
STREAMS = ("anchor", "residual", "exact")  # by priority, highest first


class Link(Protocol):
    """The link a transport charges its blocks to."""

    latency: float  # seconds from a byte's serialisation to its delivery (a pipe: paid once per stream)

    def send(self, stream: int, nbytes: int) -> float: ...  # blocks for the bytes' time; returns delivery time

    def hold(self, stream: int) -> AbstractContextManager: ...  # the stream has demand for the whole block

    def report(self) -> dict: ...  # what the link measured, for the load's timeline


class TokenBucket:
    """The bucket of the module docstring (debt model, capped at ``burst``, starting empty after an idle spell).
    Not thread-safe: its owner serialises calls (a lock, or one event loop)."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self._tokens = 0.0
        self._refilled_at: float | None = None  # the bucket starts empty at the first debit

    def debit(self, n: int, now: float, *, restart: bool = False) -> float:
        """Take ``n`` bytes' worth of tokens at time ``now``; return the seconds to wait until the debt is paid.
        ``restart``: the link was idle, so the bucket starts empty (no credit for idle time)."""
        if self._refilled_at is None or restart:
            self._refilled_at, self._tokens = now, 0.0
        self._tokens = min(self.burst, self._tokens + (now - self._refilled_at) * self.rate)
        self._refilled_at = now
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)
