"""The contract between cache loading (local tiers, object storage, TCP, an emulated link) and its consumers.

A :class:`CacheLoad` is a cache being loaded progressively: the anchor arrives first (and can be used at once),
the residual keeps arriving in the background. The decode runner only needs this interface, so every transport
(`lynxkv.stream`) and the in-memory :class:`PreparedLoad` used by tests and benchmarks are interchangeable.
"""

from __future__ import annotations

import abc
import concurrent.futures
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace

import torch

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

    def as_dict(self) -> dict:
        """A copy as a dict; ``extra`` is copied first, in one step (a load's workers may still be adding to it)."""
        return asdict(replace(self, extra=dict(self.extra)))


class CacheLoad(abc.ABC):
    """A progressively loading cache: everything the decode engine uses of a load, declared here.

    Every load implements the five abstract members. The others have defaults for a load whose residual arrives
    all at once; the progressive reader overrides them to hand out the full code layer by layer. The engine
    refuses an object that is not a :class:`CacheLoad`, and reads nothing else of it.
    """

    prompt_token_ids: list[int] | None = None
    model_fingerprint: str | None = None
    #: Whether the KV handed out has room to grow in place (:mod:`lynxkv.hf.growing`): the engine's caches may then
    #: grow into its buffers rather than copy them (one run at a time per load).
    grow_in_place: bool = False
    #: Whether :meth:`layer_in` / :meth:`full_layer` hand out the full code layer by layer as the residual lands
    #: (the layered verify). False: the engine waits for :attr:`residual` instead.
    streams_layers: bool = False

    @abc.abstractmethod
    def wait_anchor(self, timeout: float | None = None) -> KVPairs:
        """Block until every anchor page has arrived; return the anchor-only KV (dequantized). Raises
        :class:`TimeoutError` when ``timeout`` seconds pass first (0: never waits)."""

    @property
    @abc.abstractmethod
    def residual(self) -> "Future[KVPairs]":
        """Completes with the full KV (anchor + residual, dequantized) or fails with the transport's error."""

    @abc.abstractmethod
    def residual_eta(self) -> float | None:
        """Estimated seconds until the residual is complete, from the bytes seen arriving so far (None while
        unknown). Never from a configured rate: a real link tells nobody its rate."""

    @property
    @abc.abstractmethod
    def timeline(self) -> LoadTimeline: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # ---- optional: the full code layer by layer (streams_layers) -------------------------------------------------
    def layer_in(self, layer: int, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for every residual page of ``layer``; True once they are all in."""
        try:
            self.residual.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def full_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full code of one layer, once :meth:`layer_in` said it is in."""
        return self.residual.result()[layer]

    def layers_given_up(self) -> None:
        """The caller of :meth:`layer_in` takes no more layers (a layered verify given up)."""

    def residual_in(self) -> bool:
        """Whether every residual byte is in (the full code may still be being built); never waits. A residual that
        failed is not in."""
        fut = self.residual
        return fut.done() and not fut.cancelled() and fut.exception(timeout=0) is None

    def dequantize_landed(self) -> int:
        """Build, in the calling thread, the parts of the full code whose bytes are in; the number of layers built.
        The engine calls it between draft steps."""
        return 0

    def hold_early(self, on: bool) -> None:
        """``on``: the caller builds landed layers itself (:meth:`dequantize_landed`), the load's own worker leaves
        them; ``False``: the worker takes them again."""


class PreparedLoad(CacheLoad):
    """A :class:`CacheLoad` over KV tensors already in memory, releasing the anchor and the residual after
    fixed delays (seconds from construction). For tests and examples. Its ETA is the time left to the residual's
    release, which it knows because it is its own clock."""

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
