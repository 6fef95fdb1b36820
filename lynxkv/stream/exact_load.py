"""Progressive reading to the exact tier (format 1.4): anchor, then full code, then the original tensors.

:class:`ExactLoad` wraps a :class:`~lynxkv.cache.loading.CacheLoad` (the progressive reader's, or any other):
the anchor is the inner load's, as soon as it is ready, and ``residual`` completes with the cache's original
tensors bit for bit -- the full code's decoding with the exact segment applied, read beside the inner load --
once both the inner load's full code and the exact tensors are there. A runner that verifies its drafts
against ``residual`` then verifies against the original cache, so greedy output equals greedy decoding on it.
The exact segment is checked (its header, index, page CRCs and the CRC of every rebuilt page) before anything
is delivered; a wrong or corrupt one fails ``residual`` with its one clear error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from lynxkv.cache.kv import KVPairs
from lynxkv.cache.loading import CacheLoad, LoadTimeline


class ExactLoad:
    """A :class:`CacheLoad` whose ``residual`` is the exact KV: ``read_exact()`` (e.g. ``open_cache(path).load_kv(
    exact=True)``) runs in a thread from construction; ``timeline.extra["exact_ready_s"]`` records when it was
    delivered (seconds since this load was made, right after the inner one, and never before the inner timeline's
    ``residual_ready_s``: the exact tensors are delivered only after the full code)."""

    def __init__(self, inner: CacheLoad, read_exact: Callable[[], KVPairs]):
        self._inner = inner
        self._t0 = time.perf_counter()
        self._future: Future = Future()
        self._closed = threading.Event()

        def deliver() -> None:
            try:
                exact = read_exact()
                inner.residual.result()  # the full code has arrived too: the timeline keeps its order
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer through the future
                if not self._future.done():
                    self.timeline.residual_failed = str(exc)
                    self._future.set_exception(exc)
                return
            if not self._closed.is_set():
                since = time.perf_counter() - self._t0  # this load's clock; delivered after the full code, so
                self.timeline.extra["exact_ready_s"] = max(since, self.timeline.residual_ready_s or 0.0)
                self._future.set_result(exact)

        self._thread = threading.Thread(target=deliver, name="lynxkv-exact", daemon=True)
        self._thread.start()

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self._inner.prompt_token_ids

    @property
    def model_fingerprint(self) -> str | None:
        return self._inner.model_fingerprint

    def wait_anchor(self, timeout: float | None = None) -> KVPairs:
        return self._inner.wait_anchor(timeout)

    @property
    def residual(self) -> Future:
        return self._future

    def residual_eta(self) -> float | None:
        return self._inner.residual_eta()

    @property
    def timeline(self) -> LoadTimeline:
        return self._inner.timeline

    def close(self) -> None:
        self._closed.set()
        self._inner.close()
