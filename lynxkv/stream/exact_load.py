"""Progressive reading to the exact tier: anchor, then full code, then the original tensors.

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
from dataclasses import dataclass

from lynxkv.cache.kv import TORCH_DTYPES, KVPairs
from lynxkv.cache.loading import CacheLoad, LoadTimeline
from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.stream.buffer import StreamClosed


@dataclass
class ExactStage:
    """What the exact stage needs of its progressive load, handed over explicitly."""

    wait_header: Callable[[], tuple]  # blocks until the anchor header is read: (header, page reader); raises the load's error
    mode: bool | None  # True: asked for; None: only where the cache has one
    decode: bool
    dtype: object  # the torch dtype asked for, or None
    source: str
    exact_file: str | None
    timeline: LoadTimeline
    residual: Future  # the load's full code
    open_exact: Callable | None  # the transport's open_exact(header, override), None when it carries no exact segment
    device: object = None  # where the load's tensors are (None: the CPU)


def exact_stage(stage: ExactStage, future: Future, emit, now) -> None:
    """Run the exact stage and settle ``future`` with its outcome (:func:`read_exact_stage`); record
    ``exact_ready_s`` or ``exact_failed`` in the timeline's ``extra`` and emit ``exact_ready`` / ``exact_failed``."""
    from lynxkv.errors import LynxError
    from lynxkv.stream.events import LoadEvent

    timeline = stage.timeline
    try:
        result = read_exact_stage(stage)
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


def read_exact_stage(stage: ExactStage):
    """The exact stage of a progressive load: the original tensors (with ``decode``), ``None`` (without: every
    exact page's CRC checked as it arrives), or ``False`` when the load asked for the exact segment only where there
    is one and this cache has none. Raises the error that refuses it: no exact segment, another dtype, a transport
    that does not carry it, a header of another cache, a page that fails its CRC or does not rebuild its original
    bytes, or the full code's own failure."""
    h, reader = stage.wait_header()
    seg = h.segment(c.SEGMENT_EXACT)
    if seg is None:
        if stage.mode is None:
            return False
        raise InputError("this cache has no exact segment (encode it with --exact)")
    if stage.decode and stage.dtype is not None and stage.dtype != TORCH_DTYPES[h.dtype]:
        raise InputError(f"exact: the exact segment rebuilds the cache in its original dtype ({h.dtype}); it "
                         "excludes another dtype")
    if stage.open_exact is None:
        raise InputError(f"{stage.source}: this source does not carry the exact segment")
    stage.timeline.extra.setdefault("exact_bytes", 0)
    stage.timeline.extra["exact_total_bytes"] = seg.length
    try:
        buf = stage.open_exact(h, stage.exact_file)
        reader.attach_exact(buf, base=seg.offset if seg.placement == c.PLACEMENT_INLINE else 0)  # bound to the anchor
        if not stage.decode:
            for _ in reader.pages(c.SEGMENT_EXACT, decode=False):  # CRC checked here, page by page
                pass
    except StreamClosed:
        if stage.residual.done():  # the full code failed, which closed the load: its error is this stage's too
            stage.residual.result()
        raise
    if not stage.decode:
        stage.residual.result()  # the stages end in order: anchor, full code, exact
        return None
    full = stage.residual.result()  # the full code (its failure is the exact stage's too)
    # the exact coder runs on the CPU: from another device, a host copy of the full code, rebuilt, then sent back
    out = [(k.to("cpu", copy=True), v.to("cpu", copy=True)) for k, v in full]
    reader.apply_exact(out)  # page by page as the bytes arrive; each rebuilt page's CRC checked before the next
    if stage.device is not None and stage.device.type != "cpu":
        out = [(k.to(stage.device), v.to(stage.device)) for k, v in out]
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
