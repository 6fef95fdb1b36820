"""What is worth retrying, and how often: :class:`RetryPolicy`, :func:`is_transient`; how long to wait for a read
whose transport may stall: :func:`within`."""

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


def within(seconds: float | None, read: Callable[[], T], what: str) -> T:
    """``read()``, given up on after ``seconds`` (None: as long as it takes) with a :class:`TransientError`:
    ``what`` (e.g. "the anchor") did not arrive within them. ``read`` runs on a daemon thread: one stalled in its
    transport keeps neither the caller nor the process (it is left to end or die with it)."""
    if seconds is None:
        return read()
    done: dict = {}

    def work() -> None:
        try:
            done["value"] = read()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=work, name="lynxkv-bounded-read", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TransientError(f"{what} did not arrive within {seconds:g} s")
    if "error" in done:
        raise done["error"]
    return done["value"]


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
