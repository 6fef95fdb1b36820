"""The contract between cache loading (local tiers, object storage, TCP, an emulated link) and its consumers.

A :class:`CacheLoad` is a cache being loaded progressively: the anchor arrives first (and can be used at once),
the residual keeps arriving in the background. The decode runner only needs this interface, so every transport
(`lynxkv.stream`) and the in-memory :class:`PreparedLoad` used by tests and benchmarks are interchangeable.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from lynxkv.cache.kv import KVPairs



@dataclass
class LoadTimeline:
    """Seconds since the load started (``None`` until the event happened) and bytes moved per stream."""

    anchor_ready_s: float | None = None
    residual_ready_s: float | None = None
    anchor_bytes: int = 0
    residual_bytes: int = 0
    residual_failed: str | None = None
    extra: dict = field(default_factory=dict)


class CacheLoad(Protocol):
    """A progressively loading cache."""

    prompt_token_ids: list[int] | None
    model_fingerprint: str | None

    def wait_anchor(self, timeout: float | None = None) -> KVPairs:
        """Block until every anchor page has arrived; return the anchor-only KV (dequantized)."""

    @property
    def residual(self) -> "Future[KVPairs]":
        """Completes with the full KV (anchor + residual, dequantized) or fails with a LynxError."""

    def residual_eta(self) -> float | None:
        """Estimated seconds until the residual is complete, from the observed rate (None if unknown)."""

    @property
    def timeline(self) -> LoadTimeline: ...

    def close(self) -> None: ...


class PreparedLoad:
    """A :class:`CacheLoad` over KV tensors already in memory, releasing the anchor and the residual after
    fixed delays (seconds from construction). For tests, examples and latency experiments."""

    def __init__(
        self,
        anchor_kv: KVPairs,
        full_kv: KVPairs | None,
        *,
        anchor_delay: float = 0.0,
        residual_delay: float = 0.0,
        residual_error: Exception | None = None,
        prompt_token_ids: list[int] | None = None,
        model_fingerprint: str | None = None,
        anchor_bytes: int = 0,
        residual_bytes: int = 0,
        grow_in_place: bool = False,
    ):
        self.prompt_token_ids = prompt_token_ids
        # a runner's caches may grow into the room of these tensors' buffers, where they have any (the caller
        # hands them over for one run at a time: lynxkv.hf.growing)
        self.grow_in_place = grow_in_place
        self.model_fingerprint = model_fingerprint
        self._anchor_kv = anchor_kv
        self._t0 = time.perf_counter()
        self._anchor_at = self._t0 + anchor_delay
        self._residual_at = self._t0 + residual_delay
        self._timeline = LoadTimeline(anchor_bytes=anchor_bytes, residual_bytes=residual_bytes)
        self._future: Future = Future()
        self._closed = threading.Event()

        def deliver() -> None:
            if self._closed.wait(max(0.0, self._residual_at - time.perf_counter())):
                return
            if residual_error is not None or full_kv is None:
                err = residual_error or RuntimeError("no residual")
                self._timeline.residual_failed = str(err)
                self._future.set_exception(err)
            else:
                self._timeline.residual_ready_s = time.perf_counter() - self._t0
                self._future.set_result(full_kv)

        self._thread = threading.Thread(target=deliver, name="lynxkv-prepared-residual", daemon=True)
        self._thread.start()

    def wait_anchor(self, timeout: float | None = None) -> KVPairs:
        delay = self._anchor_at - time.perf_counter()
        if delay > 0:
            if timeout is not None and delay > timeout:
                raise TimeoutError("anchor not ready")
            time.sleep(delay)
        if self._timeline.anchor_ready_s is None:
            self._timeline.anchor_ready_s = time.perf_counter() - self._t0
        return self._anchor_kv

    @property
    def residual(self) -> Future:
        return self._future

    def residual_eta(self) -> float | None:
        return max(0.0, self._residual_at - time.perf_counter())

    @property
    def timeline(self) -> LoadTimeline:
        return self._timeline

    def close(self) -> None:
        self._closed.set()
