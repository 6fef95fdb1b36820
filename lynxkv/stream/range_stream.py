"""Ordered blocks of one object's bytes, read with ranged requests (:class:`RangeStream`): the block stream every
transport over random-access storage uses (:mod:`lynxkv.stream.transport`).

Up to ``inflight`` ranged reads are in flight, handed over in order; transient failures are retried with
exponential backoff (:class:`lynxkv.storage.RetryPolicy`). A read that stalls for ``stall_timeout`` is issued
again: a stall is time in which the read is outstanding, not queued behind a higher priority, and no block of its
stream lands. The stalled read is left to a daemon thread (it never keeps the process alive). With a shared
:class:`~lynxkv.stream.link.Link` each block is charged to it in offset order. Memory is bounded by
``inflight * block_size``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable, Iterator

from lynxkv.errors import FormatError, LynxError, TransientError
from lynxkv.storage import RetryPolicy, apart, is_transient, read_range
from lynxkv.stream.buffer import StreamClosed
from lynxkv.stream.link import Link

Fetch = Callable[[int, int], bytes]
_POLL_S = 0.1  # how often a reader waiting on a fetch looks whether its stream was closed


class RangeStream:
    """Ordered blocks ``(offset, data)`` of bytes ``[start, end)`` of one object, read with ranged requests."""

    def __init__(self, url: str, start: int, end: int, *, stream: int, segment: str,
                 link: Link | None = None, fetch: Fetch | None = None, block_size: int = 1 << 20,
                 inflight: int = 4, retry: RetryPolicy | None = None, storage_options: dict | None = None,
                 on_retry: Callable[[str], None] | None = None, after: threading.Event | None = None):
        self.url, self.start, self.end = url, start, end
        self.stream, self.segment = stream, segment
        self.link = link
        self.fetch = fetch or (lambda a, b: read_range(url, a, b, storage_options))
        self.block_size = block_size
        self.inflight = max(1, inflight)
        self.retry = retry or RetryPolicy()
        self.on_retry = on_retry
        # Until `after` is set (a higher priority is still loading): one request in flight, nothing on the link.
        self.after = after
        self.retries = 0
        self._landed_at = 0.0  # time.monotonic() of the last block of this stream that arrived
        self._closed = threading.Event()
        # The blocks in flight take the link in offset order, one after another, as one connection's bytes do:
        # charged side by side, their quanta would interleave and every block in flight would finish late, all
        # together (the residual's last layers arriving as one burst at its end).
        self._charge_turn = threading.Condition()
        self._charged_to = start

    def close(self) -> None:
        self._closed.set()

    def _await(self, fut: cf.Future) -> bytes:
        """The fetch's bytes; ``cf.TimeoutError`` once it has stalled for ``stall_timeout`` seconds, or
        :class:`StreamClosed` as soon as the stream is closed (a stalled read is left to its thread).

        A stall is time in which the request is outstanding and nothing arrives: the clock is held while a higher
        priority is still loading (``after`` unset: the request's bytes wait behind the anchor's, at the server and
        on the link, by design), and it restarts whenever a block of this stream lands (the stream moves; this
        block is one of several sharing it). A residual queued behind a slow anchor is not a stall; timed from
        its submission it would be abandoned, and read again from a server that may be gone by then."""
        since = time.monotonic()
        while True:
            if self._closed.is_set():
                raise StreamClosed(f"{self.segment} stream closed")
            now = time.monotonic()
            if self.after is not None and not self.after.is_set():
                since = now
            since = max(since, self._landed_at)
            left = since + self.retry.stall_timeout - now
            if left <= 0:
                raise cf.TimeoutError
            try:
                data = fut.result(timeout=min(left, _POLL_S))
            except cf.TimeoutError:
                continue
            self._landed_at = time.monotonic()
            return data

    def _read_block(self, a: int, b: int) -> tuple[bytes, float]:
        """One block, retried with backoff; a read stalled for ``stall_timeout`` (:meth:`_await`) is abandoned."""
        last: BaseException | None = None
        for k in range(self.retry.attempts):
            if self._closed.is_set():
                raise StreamClosed(f"{self.segment} stream closed")
            if k:
                self.retries += 1
                if self.on_retry:
                    self.on_retry(f"{self.segment} bytes {a}-{b}: {last}; retry {k} of {self.retry.attempts - 1}")
                time.sleep(self.retry.delay(k - 1))
            try:
                data = self._await(_fetch_apart(self.fetch, a, b, self.segment))
            except cf.TimeoutError:
                last = TransientError(f"stalled: no answer for {self.retry.stall_timeout:g} s")
                continue
            except StreamClosed:
                raise
            except BaseException as exc:  # noqa: BLE001
                if not is_transient(exc):
                    raise
                last = exc
                continue
            if len(data) != b - a:
                if len(data) < b - a:  # a truncated object: retrying once is cheap, then it is an error
                    last = FormatError(
                        f"{self.segment} segment truncated: bytes {a}-{b} requested, {len(data)} returned "
                        f"(object ends at {a + len(data)}, the index says {self.end})",
                        field="segment length", where=self.segment)
                    continue
                raise FormatError(f"{self.segment}: read of bytes {a}-{b} returned {len(data)} bytes",
                                  where=self.segment)
            # Charge the shared link here, in the block's own worker, so that the latency of several blocks in
            # flight overlaps (a pipe) while the bucket still serialises their bytes one after another.
            delivered = 0.0
            if self.link is not None:
                while self.after is not None and not self.after.wait(0.05):
                    if self._closed.is_set():
                        raise StreamClosed(f"{self.segment} stream closed")
                with self._charge_turn:
                    while self._charged_to != a:
                        if self._closed.is_set():
                            raise StreamClosed(f"{self.segment} stream closed")
                        self._charge_turn.wait(0.05)
                try:
                    delivered = self.link.send(self.stream, len(data))
                finally:
                    with self._charge_turn:
                        self._charged_to = b
                        self._charge_turn.notify_all()
            return data, delivered
        if isinstance(last, LynxError) and not isinstance(last, TransientError):
            raise last
        raise TransientError(f"{self.segment} segment at {self.url}: bytes {a}-{b} failed after "
                             f"{self.retry.attempts} attempts: {last}")

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        # Readers for the blocks (each may itself wait on a stalled fetch, which runs on a thread of its own).
        block_pool = cf.ThreadPoolExecutor(self.inflight, thread_name_prefix=f"lynxkv-{self.segment}-blk")
        pending: list[tuple[int, cf.Future]] = []
        try:
            nxt = self.start
            while nxt < self.end or pending:
                limit = 1 if self.after is not None and not self.after.is_set() else self.inflight
                while nxt < self.end and len(pending) < limit:
                    b = min(nxt + self.block_size, self.end)
                    pending.append((nxt, block_pool.submit(self._read_block, nxt, b)))
                    nxt = b
                a, fut = pending.pop(0)
                data, delivered = fut.result()
                lag = delivered - time.perf_counter()
                if lag > 0:
                    time.sleep(lag)  # the link's latency: bytes arrive `latency` after they were serialised
                yield a, data
        finally:
            self._closed.set()
            for _, f in pending:
                f.cancel()
            block_pool.shutdown(wait=False, cancel_futures=True)


def _fetch_apart(fetch: Fetch, a: int, b: int, name: str) -> cf.Future:
    """``fetch(a, b)`` on a daemon thread of its own (:func:`lynxkv.storage.retry.apart`): the reader abandons a
    read that stalls past its bound, and an abandoned read must not keep the process from exiting."""
    return apart(lambda: fetch(a, b), f"lynxkv-{name}-get")
