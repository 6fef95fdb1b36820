"""Progressive reading to the exact tier (format 1.4): anchor, then full code, then the original tensors.

:func:`read_exact_stage` is the progressive reader's third stage (``open_progressive(..., exact=True)``, run on
its exact worker): the exact segment's bytes arrive behind the residual's through the load's transport, its header
is checked against the anchor, and its pages are applied, each checked, to a copy of the full code once that is in.

:class:`ExactLoad` wraps a :class:`~lynxkv.cache.loading.CacheLoad` (the progressive reader's, or any other):
the anchor is the inner load's, as soon as it is ready, and ``residual`` completes with the cache's original
tensors bit for bit -- the full code's decoding with the exact segment applied (``lynxkv run --exact``: the
progressive load's own exact stage, :func:`read_exact_stage`) -- once both the inner load's full code and the
exact tensors are there. A runner that verifies its drafts
against ``residual`` then verifies against the original cache, so greedy output equals greedy decoding on it.
The exact segment is checked (its header, index, page CRCs and the CRC of every rebuilt page) before anything
is delivered; a wrong or corrupt one fails ``residual`` with its one clear error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from lynxkv.cache.kv import TORCH_DTYPES, KVPairs
from lynxkv.cache.loading import CacheLoad, LoadTimeline
from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.stream.buffer import StreamClosed


def exact_stage(load, future, timeline: LoadTimeline, emit, now) -> None:
    """Run the exact stage of ``load`` and settle ``future`` with its outcome (:func:`read_exact_stage`); record
    ``exact_ready_s`` or ``exact_failed`` in ``timeline.extra`` and emit ``exact_ready`` / ``exact_failed``."""
    from lynxkv.errors import LynxError
    from lynxkv.stream.events import LoadEvent

    try:
        result = read_exact_stage(load)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
        if not isinstance(exc, LynxError):
            exc = LynxError(f"exact segment: {type(exc).__name__}: {exc}")
        timeline.extra["exact_failed"] = str(exc)
        future.set_exception(exc)
        emit(LoadEvent("exact_failed", now(), message=str(exc)))
        return
    if result is False:  # no exact segment, and it was asked for only where there is one
        future.set_result(None)
        return
    timeline.extra["exact_ready_s"] = now()
    future.set_result(result)
    emit(LoadEvent("exact_ready", now()))


def read_exact_stage(load):
    """The exact stage of the :class:`~lynxkv.stream.progressive.ProgressiveLoad` ``load``: the original tensors
    (with ``load.decode``), ``None`` (without: every exact page's CRC checked as it arrives), or ``False`` when the
    load asked for the exact segment only where there is one and this cache has none. Raises the error that
    refuses it: no exact segment, another dtype, a transport that does not carry it, a header of another cache,
    a page that fails its CRC or does not rebuild its original bytes, or the full code's own failure."""
    while not load._header_ready.wait(0.2):
        if load._closed.is_set() or load._anchor_done.is_set():
            raise load._anchor_error or load._fatal or StreamClosed("load closed")
    h, reader = load.header, load._reader
    seg = h.segment(c.SEGMENT_EXACT)
    if seg is None:
        if load.exact_mode is None:
            return False
        raise InputError("this cache has no exact segment (encode it with --exact)")
    if load.decode and load.dtype is not None and load.dtype != TORCH_DTYPES[h.dtype]:
        raise InputError(f"exact: the exact segment rebuilds the cache in its original dtype ({h.dtype}); it "
                         "excludes another dtype")
    open_exact = getattr(load._transport, "open_exact", None)
    if open_exact is None:
        raise InputError(f"{load.source}: this source does not carry the exact segment")
    load._timeline.extra.setdefault("exact_bytes", 0)
    load._timeline.extra["exact_total_bytes"] = seg.length
    try:
        buf = open_exact(h, load._exact_file)
        reader.attach_exact(buf, base=seg.offset if seg.placement == c.PLACEMENT_INLINE else 0)  # bound to the anchor
        if not load.decode:
            for _ in reader.pages(c.SEGMENT_EXACT, decode=False):  # CRC checked here, page by page
                pass
    except StreamClosed:
        if load.residual.done():  # the full code failed, which closed the load: its error is this stage's too
            load.residual.result()
        raise
    if not load.decode:
        load.residual.result()  # the stages end in order: anchor, full code, exact
        return None
    full = load.residual.result()  # the full code (its failure is the exact stage's too)
    out = [(k.clone(), v.clone()) for k, v in full]
    reader.apply_exact(out)  # page by page as the bytes arrive; each rebuilt page's CRC checked before the next
    return out


class ExactLoad(CacheLoad):
    """A :class:`CacheLoad` whose ``residual`` is the exact KV: ``read_exact()`` (e.g. ``load.exact.result`` of a
    progressive load opened with ``exact=True``, or ``open_cache(path).load_kv(exact=True)``) runs in a thread
    from construction; ``timeline.extra["exact_ready_s"]`` records when it was
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
