"""What is worth retrying, and how often: :class:`RetryPolicy`, :func:`is_transient`."""

from __future__ import annotations

import concurrent.futures as cf

from lynxkv.errors import LynxError, TransientError


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
