"""Ordered block streams over one segment: the transport half of the progressive reader.

A source yields ``(offset, data)`` blocks of one segment in offset order, from a start offset to the end. Two
kinds exist:

- :class:`RangeSource` over random-access storage (any fsspec URL, or an injected ``fetch(start, end)`` for
  tests): it keeps up to ``inflight`` ranged reads in flight (object stores answer several GETs in parallel),
  hands blocks over in order, and retries transient failures with exponential backoff; a read that does not
  answer within ``stall_timeout`` counts as a transient failure and is issued again. Memory is bounded by
  ``inflight * block_size``.
- the TCP stream (``lynxkv.stream.tcp``), which is sequential by nature and resumes from an offset on retry.

Every block passes through the emulated link (if one is given) before it is handed over, charged to its stream
(anchor or residual), so both segments share one token bucket with strict anchor priority.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable, Iterator

from lynxkv.errors import FormatError, InputError, LynxError
from lynxkv.stream.link import EmulatedLink
from lynxkv.stream.tiers import TransientError, read_range

Fetch = Callable[[int, int], bytes]


class RetryPolicy:
    """``attempts`` tries per block, sleeping ``base * 2**k`` (capped at ``cap``) between them."""

    def __init__(self, attempts: int = 4, base: float = 0.05, cap: float = 1.0, stall_timeout: float = 10.0):
        self.attempts = attempts
        self.base = base
        self.cap = cap
        self.stall_timeout = stall_timeout

    def delay(self, k: int) -> float:
        return min(self.cap, self.base * (2**k))


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: our TransientError, timeouts and connection-level OSErrors; not missing files, bad
    arguments or checksum failures."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, LynxError):
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    return isinstance(exc, (OSError, TimeoutError, ConnectionError, cf.TimeoutError))


class RangeSource:
    """Ordered blocks of bytes ``[start, end)`` of one segment, read with ranged requests."""

    def __init__(self, url: str, start: int, end: int, *, stream: int, segment: str,
                 link: EmulatedLink | None = None, fetch: Fetch | None = None, block_size: int = 1 << 20,
                 inflight: int = 4, retry: RetryPolicy | None = None, storage_options: dict | None = None,
                 on_retry: Callable[[str], None] | None = None):
        self.url, self.start, self.end = url, start, end
        self.stream, self.segment = stream, segment
        self.link = link
        self.fetch = fetch or (lambda a, b: read_range(url, a, b, storage_options))
        self.block_size = block_size
        self.inflight = max(1, inflight)
        self.retry = retry or RetryPolicy()
        self.on_retry = on_retry
        self.retries = 0
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()

    def truncate(self, end: int) -> None:
        """Stop at ``end`` (e.g. where the anchor section of a single-file cache ends): blocks not yet issued
        are not read, blocks in flight are cut."""
        self.end = min(self.end, end)

    def _read_block(self, pool: cf.ThreadPoolExecutor, a: int, b: int) -> tuple[bytes, float]:
        """One block, retried with backoff; a stalled read is abandoned after ``stall_timeout``."""
        last: BaseException | None = None
        for k in range(self.retry.attempts):
            if self._closed.is_set():
                raise LynxError(f"{self.segment} stream closed")
            if k:
                self.retries += 1
                if self.on_retry:
                    self.on_retry(f"{self.segment} bytes {a}-{b}: {last}; retry {k} of {self.retry.attempts - 1}")
                time.sleep(self.retry.delay(k - 1))
            fut = pool.submit(self.fetch, a, b)
            try:
                data = fut.result(timeout=self.retry.stall_timeout)
            except cf.TimeoutError:
                last = TransientError(f"no answer within {self.retry.stall_timeout:g} s")
                continue
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
            delivered = self.link.send(self.stream, len(data)) if self.link is not None else 0.0
            return data, delivered
        if isinstance(last, LynxError):
            raise last
        raise TransientError(f"{self.segment} segment at {self.url}: bytes {a}-{b} failed after "
                             f"{self.retry.attempts} attempts: {last}")

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        # Readers for the blocks (each may itself wait on a stalled fetch), and the fetch workers underneath.
        fetch_pool = cf.ThreadPoolExecutor(self.inflight * 2, thread_name_prefix=f"lynxkv-{self.segment}-get")
        block_pool = cf.ThreadPoolExecutor(self.inflight, thread_name_prefix=f"lynxkv-{self.segment}-blk")
        pending: list[tuple[int, cf.Future]] = []
        try:
            nxt = self.start
            while nxt < self.end or pending:
                while nxt < self.end and len(pending) < self.inflight:
                    b = min(nxt + self.block_size, self.end)
                    pending.append((nxt, block_pool.submit(self._read_block, fetch_pool, nxt, b)))
                    nxt = b
                a, fut = pending.pop(0)
                data, delivered = fut.result()
                lag = delivered - time.perf_counter()
                if lag > 0:
                    time.sleep(lag)  # the link's latency: bytes arrive `latency` after they were serialised
                if a >= self.end:
                    continue  # issued before a truncate()
                yield a, data[: self.end - a]
        finally:
            self._closed.set()
            for _, f in pending:
                f.cancel()
            block_pool.shutdown(wait=False, cancel_futures=True)
            fetch_pool.shutdown(wait=False, cancel_futures=True)


def check_local_exists(url: str) -> None:
    import os

    from lynxkv.stream.tiers import is_local, local_path

    if is_local(url) and not os.path.exists(local_path(url)):
        raise InputError(f"{url}: no such file")
