"""What is worth retrying, and how often: :class:`RetryPolicy`, :func:`is_transient`; how long to wait for a read
whose transport may stall: :func:`apart`, :func:`within`, :func:`retried`."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable, TypeVar

from lynxkv.errors import LynxError, TransientError


T = TypeVar("T")


class RetryPolicy:
    """``attempts`` tries per read, sleeping ``base * 2**k`` (capped at ``cap``) between them; a read that does not
    answer within ``stall_timeout`` seconds counts as a transient failure."""

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


def apart(call: Callable[[], T], name: str) -> "cf.Future[T]":
    """``call()`` on a daemon thread of its own, its result (or error) in the future returned. A read can block for
    good (a peer that keeps its connection open and sends nothing): its waiter gives up on the future, and the
    abandoned read must not keep the process from exiting, as a pool's worker would (the interpreter joins those
    at exit)."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(exc)

    threading.Thread(target=run, daemon=True, name=name).start()
    return fut


def within(seconds: float | None, read: Callable[[], T], what: str) -> T:
    """``read()``, given up on after ``seconds`` (None: as long as it takes) with a :class:`TransientError`:
    ``what`` (e.g. "the anchor") did not arrive within them. ``read`` runs :func:`apart`: one stalled in its
    transport keeps neither the caller nor the process (it is left to end or die with it)."""
    if seconds is None:
        return read()
    fut = apart(read, "lynxkv-bounded-read")
    if not cf.wait([fut], timeout=seconds).done:  # (a TimeoutError of read's own is raised as it is, below)
        raise TransientError(f"{what} did not arrive within {seconds:g} s")
    return fut.result()


def retried(read: Callable[[], T], retry: RetryPolicy, what: str) -> T:
    """``read()`` under ``retry``: a transient failure, or no answer within its ``stall_timeout`` (:func:`within`),
    is tried again after its backoff, ``attempts`` times in all; then a :class:`TransientError` says why."""
    last: BaseException | None = None
    for k in range(retry.attempts):
        if k:
            time.sleep(retry.delay(k - 1))
        try:
            return within(retry.stall_timeout, read, what)
        except BaseException as exc:  # noqa: BLE001 - sorted by is_transient
            if not is_transient(exc):
                raise
            last = exc
    raise TransientError(f"{what}: failed after {retry.attempts} attempts: {last}")
