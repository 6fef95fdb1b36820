"""The progressive reader: a cache loading anchor first, page by page, from any tier (an HTTP server included).

``open_progressive(source)`` returns a :class:`ProgressiveLoad` (the :class:`~lynxkv.cache.loading.CacheLoad` the
decode runner consumes): the load's handle and its two parser threads, here; its consumer thread is
:mod:`lynxkv.stream.consumer`. The bytes come from a transport (:mod:`lynxkv.stream.transport`, picked
by URL scheme), which owns the pumps, the range reads and the link. One *parser* thread per segment walks it with
the page reader (CRC-32 checked, no tensor work); one *consumer* takes the page records from a priority queue,
anchor pages first, emits ``anchor_page`` -> ``anchor_ready`` -> ``residual_page`` -> ``residual_ready`` (or
``residual_failed``), and builds the KV (:mod:`lynxkv.stream.assembly`): the anchor batch by batch as its pages
arrive, the full code once the whole residual is in, at the lowest CPU priority, so that a model drafting on the
anchor keeps every core. Buffers are bounded (16 MiB per segment beyond what its parser used, ``inflight x
block_size`` in flight, ``max_pending_pages`` residual pages). A final residual failure fails the whole load
unless ``allow_anchor_only`` (then the anchor stays usable, flagged lossy). Asked for it (``exact``), an *exact*
worker reads the exact segment behind the residual, page by page, and once the full code is in
applies it to a copy of the full code: ``load.exact`` completes with the original tensors bit for bit, or fails
with one clear error (a wrong or corrupt exact segment) before any of them is handed out; the anchor and the full
code stay usable. docs/tiers.md, "Inside the progressive reader", says why each choice was made and what the
timeline records.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Iterator

import torch

from lynxkv.errors import InputError, LynxError, ResidualUnavailable
from lynxkv.format import constants as c
from lynxkv.format.reader import PageReader
from lynxkv.cache.kv import KVPairs, resolve_device
from lynxkv.cache.loading import CacheLoad, LoadTimeline
from lynxkv.storage import RetryPolicy
from lynxkv.stream.link import Link
from lynxkv.stream.assembly import KVAssembly
from lynxkv.stream.buffer import StreamClosed
from lynxkv.stream.arrivals import ArrivalTransfer, layer_arrivals
from lynxkv.stream.consumer import LoadConsumer
from lynxkv.stream.events import EventLog, LoadEvent
from lynxkv.stream.exact_load import ExactStage, exact_stage
from lynxkv.stream.transport import Fetch, open_transport

_LIVE: "weakref.WeakSet[ProgressiveLoad]" = weakref.WeakSet()


@atexit.register
def _close_live_loads() -> None:
    """Join the workers of loads still open at exit: a daemon thread torn down inside torch code at interpreter
    shutdown aborts the process ("terminate called without an active exception")."""
    for load in list(_LIVE):
        load.close()


class ProgressiveLoad(LoadConsumer, CacheLoad):
    """A cache loading progressively (see the module docstring). Use :func:`open_progressive` to make one."""

    def __init__(self, source: str, *, residual: str | None = None, link: Link | None = None,
                 on_event: Callable[[LoadEvent], None] | None = None, allow_anchor_only: bool = False,
                 storage_options: dict | None = None, inflight: int = 4, block_size: int = 1 << 20,
                 retry: RetryPolicy | None = None, dtype: torch.dtype | None = None,
                 fetch_hook: Callable[[str, Fetch], Fetch] | None = None, max_pending_pages: int = 64,
                 decode: bool = True, tee: Callable[[str, int, bytes], None] | None = None, allow_locations=(),
                 exact: bool | None = False, exact_file: str | None = None, room: int = 0, device=None):
        self.source = source
        self.device = resolve_device(device)  # checked before any thread starts
        self.link = link
        self.allow_anchor_only = allow_anchor_only
        self.dtype = dtype  # None: fp32, or with the exact stage the cache's own dtype (known from the header)
        if room < 0:
            raise InputError(f"room: expected >= 0 tokens, got {room}")
        self.room = int(room)
        self.decode = decode
        self.exact_mode = True if exact_file is not None else exact  # None: when the cache has an exact segment
        self._exact_file = exact_file
        self._exact_future: Future = Future()
        self._parts_left = 2 if self.exact_mode is not False else 1  # the consumer and the exact worker end the load
        self._parts_lock = threading.Lock()

        self.header = None
        self.prompt_token_ids: list[int] | None = None
        self.model_fingerprint: str | None = None

        self._t0 = time.perf_counter()
        self._timeline = LoadTimeline()
        self._timeline.extra.update(anchor_first_s=None, anchor_arrived_s=None, residual_first_s=None,
                                    residual_arrived_s=None, retries=[])
        # The transport gets a clock of its own, not the bound ``self._now``: nothing it holds may point back at
        # the load, so a load nobody references is freed at once, its KV with it (not at the next full garbage
        # collection: a batch opens loads one after another, and each would keep its KV until then).
        t0 = self._t0
        self._transfer = ArrivalTransfer(self._timeline, lambda: time.perf_counter() - t0, link=link, tee=tee)
        self._transport = open_transport(source, self._transfer, residual=residual, storage_options=storage_options,
                                         inflight=inflight, block_size=block_size, retry=retry or RetryPolicy(),
                                         fetch_hook=fetch_hook, allow_locations=allow_locations)
        self._log = EventLog(on_event)
        self._header_ready = threading.Event()
        self._outputs_ready = threading.Event()  # the consumer has read the header (and made the KV outputs)
        self._anchor_done = threading.Event()
        self._residual_go = threading.Event()  # the residual parser may start: the anchor is ready, or the load ended
        self._anchor_kv: KVPairs | None = None
        self._anchor_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._future: Future = Future()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._max_pending = max_pending_pages
        self._residual_slots = threading.Semaphore(max_pending_pages)
        self._closed = threading.Event()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._residual_bytes_total: int | None = None
        self._kv: KVAssembly | None = None  # the outputs, once the header is in
        self._reader: PageReader | None = None
        self._prefaulter: threading.Thread | None = None  # started by the consumer with the outputs
        self._threads = [
            threading.Thread(target=self._guard, args=("anchor", self._anchor_worker), daemon=True,
                             name="lynxkv-anchor"),
            threading.Thread(target=self._guard, args=("residual", self._residual_worker), daemon=True,
                             name="lynxkv-residual"),
            threading.Thread(target=self._consumer, daemon=True, name="lynxkv-consumer"),
        ]
        if self.exact_mode is not False:
            self._threads.append(threading.Thread(target=self._exact_worker, daemon=True, name="lynxkv-exact"))
        else:
            self._exact_future.set_exception(InputError("this load was not asked for the exact segment "
                                                        "(open_progressive(..., exact=True))"))
        _LIVE.add(self)
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------------------ public API
    def wait_anchor(self, timeout: float | None = None) -> KVPairs:
        if not self._anchor_done.wait(timeout):
            raise TimeoutError("anchor not ready")
        if self._anchor_error is not None:
            raise self._anchor_error
        if self._fatal is not None:
            raise self._fatal
        return self._anchor_kv  # type: ignore[return-value]

    @property
    def residual(self) -> Future:
        return self._future

    @property
    def exact(self) -> Future:
        """Completes once the exact segment has arrived and checked out: with the original tensors bit for
        bit (in the cache's dtype; ``None`` with ``decode=False``, or when ``exact=None`` and the cache has no
        exact segment), or with the error that refused it."""
        return self._exact_future

    @property
    def exact_url(self) -> str | None:
        """Where the exact segment is being read from (once known)."""
        return getattr(self._transport, "exact_url", None)

    @property
    def grow_in_place(self) -> bool:
        """Whether a runner's caches may grow into the room of the KV this load hands out
        (:mod:`lynxkv.hf.growing`)."""
        return self.room > 0

    @property
    def streams_layers(self) -> bool:
        """The full code comes layer by layer (:meth:`layer_in`, :meth:`full_layer`) unless ``decode=False``."""
        return self.decode

    @property
    def sizes(self) -> tuple[int | None, int | None]:
        """(anchor bytes, residual bytes) to transfer, as far as known yet (None until known)."""
        return (self._transport.anchor_size or None), self._residual_bytes_total

    @property
    def residual_url(self) -> str | None:
        """Where the residual is being read from (once known)."""
        return self._transport.residual_url

    @property
    def anchor_error(self) -> BaseException | None:
        """The error that made the anchor unusable (None while it is fine)."""
        return self._anchor_error

    @property
    def anchor_only(self) -> bool:
        """True when the residual failed and only the lossy anchor is available."""
        return self._timeline.residual_failed is not None

    def residual_eta(self) -> float | None:
        if self._future.done():
            return 0.0
        anchor_left = 0 if self._anchor_done.is_set() or self.header is None else max(
            0, (self._transport.anchor_size or 0) - self._timeline.anchor_bytes)
        return self._transfer.residual_eta(self._residual_bytes_total, anchor_left)

    def layer_in(self, layer: int, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for every residual page of ``layer``; True once they are all in. The
        load's failure is raised here (a closed load raises :class:`StreamClosed`). ``timeout=0`` never waits.

        From the first call on, the caller takes the layers itself as it reaches them (the load no longer
        dequantizes them early), until :meth:`layers_given_up`."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float:  # each wait in 50 ms slices (the load's failure is checked between them), never past
            return 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))

        while True:
            if self._future.done():
                self._future.result()  # the load's error, if it failed
            if self._outputs_ready.wait(left()):  # woken by the consumer, or again to check the load
                if not self.decode:
                    raise InputError("a load opened with decode=False has no full code to hand out")
                kv = self._kv
                kv.urgent = True
                if kv.layer_in(layer, left()):
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def layers_given_up(self) -> None:
        """The caller of :meth:`layer_in` takes no more layers (a layered verify given up): the layers already in
        and those still to come are dequantized early again, on the load's own worker."""
        if self._outputs_ready.is_set() and self.decode:
            self._kv.relax()

    def residual_in(self) -> bool:
        """Whether every byte of the residual is in (its last layers may still be being dequantized); never waits."""
        return self._outputs_ready.is_set() and self.decode and self._kv.all_in()

    def dequantize_landed(self) -> int:
        """Dequantize, in the calling thread, the layers whose residual is in and that no worker has begun (the
        runner calls it between draft steps, so that little is left to do when the last byte lands); never waits.
        Returns how many layers it did."""
        if not (self._outputs_ready.is_set() and self.decode) or self._future.done():
            return 0
        return self._kv.take_landed()

    def hold_early(self, on: bool) -> None:
        """``on``: the caller dequantizes the landed layers itself between its steps (:meth:`dequantize_landed`; the
        runner, while it drafts), so the load's early worker leaves them to it; ``False``: the worker takes them
        again. Only who dequantizes a layer, and when, changes: the load still builds every layer by its end."""
        if self._outputs_ready.is_set() and self.decode:
            self._kv.hold(on)

    def full_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full code of one layer once :meth:`layer_in` said its residual is all in, dequantized in the calling
        thread (the runner's layered verify, :mod:`lynxkv.speculative.layered`)."""
        try:
            return self._kv.full_layer(layer)
        except LynxError:
            if self._future.done():
                self._future.result()  # the load's own error
            raise

    @property
    def timeline(self) -> LoadTimeline:
        if self.link is not None:
            self._timeline.extra["link"] = self.link.report()
        return self._timeline

    def events(self, timeout: float | None = None) -> Iterator[LoadEvent]:
        """Every event from the start, as it happens; ends after ``residual_ready`` / ``residual_failed`` (and, with
        the exact stage, after ``exact_ready`` / ``exact_failed``).
        Raises the load's error at the end when the load failed (and anchor-only was not allowed)."""
        yield from self._log.follow(timeout)
        err = self._anchor_error or self._fatal
        if err is not None:
            raise err

    def __iter__(self) -> Iterator[LoadEvent]:
        return self.events()

    def close(self) -> None:
        self._closed.set()
        self._residual_go.set()  # a residual worker waiting for the anchor sees the close
        self._residual_slots.release(self._max_pending + 1)  # a residual worker waiting for a slot sees the close
        self._transport.close()
        self._queue.put((-1, -1, ("stop",)))  # ahead of every queued page: a closed load decodes nothing more
        for t in self._threads:  # let the workers leave torch code before the caller goes on (or exits)
            if t is not threading.current_thread():
                t.join(timeout=5)
        if self._prefaulter is not None:  # (read once the consumer, which starts it, is done)
            self._prefaulter.join(timeout=5)

    def __enter__(self) -> "ProgressiveLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ plumbing
    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _emit(self, ev: LoadEvent) -> None:
        self._log.emit(ev)

    def _put(self, prio: int, item: tuple) -> None:
        self._queue.put((prio, self._next_seq(), item))

    def _next_seq(self) -> int:
        """The next queue sequence number: items of one priority leave the queue in the order they were put."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def _guard(self, segment: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which decides
            if not isinstance(exc, LynxError):
                exc = LynxError(f"{segment} segment: {type(exc).__name__}: {exc}")
            self._put(0 if segment == "anchor" else 1, ("error", segment, exc))

    # ------------------------------------------------------------------------------------------ parsers
    def _anchor_worker(self) -> None:
        buf = self._transport.open_anchor()
        # An inline residual (single-file cache) lies after the anchor section: the page reader checks the file's
        # exact length against header + both inline sections.
        self._reader = reader = PageReader(buf)
        h = self.header = reader.header
        seg = h.segment(c.SEGMENT_RESIDUAL)  # its length is known now, before the residual's worker runs
        self._residual_bytes_total = seg.length if seg is not None else None
        self.prompt_token_ids = list(h.prompt_token_ids) or None
        self.model_fingerprint = h.fingerprint or None
        reader.index(c.SEGMENT_ANCHOR)
        self._header_ready.set()
        self._put(0, ("header", h))
        for layer, page, entry, raw in reader.pages(c.SEGMENT_ANCHOR, decode=False):  # CRC checked here
            self._put(0, ("anchor", layer, page, raw if self.decode else None, entry.stored_length))
        self._timeline.extra["anchor_arrived_s"] = self._now()
        buf.unregister("anchor")
        self._put(0, ("anchor_done",))

    def _residual_worker(self) -> None:
        while not self._header_ready.wait(0.2):
            if self._closed.is_set():
                return
            # The anchor failed before its header (the consumer reports it). The flag is read before the header's:
            # a header that came in just as the wait timed out, and a whole anchor after it, still go on to here.
            if self._anchor_done.is_set() and not self._header_ready.is_set():
                return
        h, reader = self.header, self._reader
        seg = h.segment(c.SEGMENT_RESIDUAL)
        if seg is None:
            raise ResidualUnavailable("this cache has no residual segment")
        buf = self._transport.open_residual(h)
        reader.attach_residual(buf, base=seg.offset if seg.placement == c.PLACEMENT_INLINE else 0)
        # Residual pages wait for the anchor anyway (the consumer holds them until it is ready), so they are read
        # and checked once it is dequantized: then they take no CPU from it. The bytes keep arriving meanwhile.
        self._residual_go.wait()
        if self._closed.is_set() or self._fatal is not None:
            return  # closed, or the load failed (the consumer reports it)
        for layer, page, entry, raw in reader.pages(c.SEGMENT_RESIDUAL, decode=False):
            while not self._residual_slots.acquire(timeout=0.2):  # bounded: the consumer holds these back
                if self._closed.is_set():
                    return
            if self._closed.is_set():  # close() frees the slots to end this wait
                return
            self._put(1, ("residual", layer, page, raw if self.decode else None, entry.stored_length))
        self._timeline.extra["residual_arrived_s"] = self._now()
        self._timeline.extra["residual_layers"] = layer_arrivals(self._transfer.residual_blocks,
                                                                 reader.index(c.SEGMENT_RESIDUAL))
        self._put(1, ("residual_done",))

    # ------------------------------------------------------------------------------------------ exact
    def _wait_header(self) -> tuple:
        """(header, page reader) once the consumer has read the header; the load's error if it ended first."""
        while not self._header_ready.wait(0.2):
            if self._closed.is_set() or self._anchor_done.is_set():
                raise self._anchor_error or self._fatal or StreamClosed("load closed")
        return self.header, self._reader

    def _exact_worker(self) -> None:
        stage = ExactStage(self._wait_header, self.exact_mode, self.decode, self.dtype, self.source, self._exact_file,
                           self._timeline, self._future, getattr(self._transport, "open_exact", None), self.device)
        try:
            exact_stage(stage, self._exact_future, self._emit, self._now)
        finally:
            self._drop_locals(self._failure(self._exact_future))
            self._part_ended()


def open_progressive(source: str, *, residual: str | None = None, on_event: Callable[[LoadEvent], None] | None = None,
                     allow_anchor_only: bool = False, storage_options: dict | None = None, inflight: int = 4,
                     block_size: int = 1 << 20, retry: RetryPolicy | None = None,
                     dtype: torch.dtype | None = None, link: Link | None = None,
                     fetch_hook: Callable[[str, Fetch], Fetch] | None = None, decode: bool = True,
                     tee: Callable[[str, int, bytes], None] | None = None, allow_locations=(),
                     exact: bool | None = False, exact_file: str | None = None, room: int = 0,
                     device=None) -> ProgressiveLoad:
    """Start loading a cache progressively and return at once (a :class:`~lynxkv.cache.loading.CacheLoad`).

    ``source``: the anchor file as a path or URL (``file://``, ``s3://``, ``http(s)://``, ``memory://``), or
    ``http://HOST:PORT/NAME`` of ``lynxkv serve``. ``residual`` overrides where the residual lives (default: the location
    the anchor header records, followed under the trust rule of :func:`lynxkv.storage.resolve_location`: inside
    the anchor's directory, or under a prefix of ``allow_locations`` / ``$LYNXKV_ALLOW_LOCATIONS``). ``link`` charges every block to a :class:`~lynxkv.stream.link.Link`
    (an emulated one for benchmarks: :func:`lynxkv.bench.emulated_link.link_at`); nothing reads its rate.
    ``allow_anchor_only`` lets the anchor survive a failed residual (flagged lossy; see the module docstring).
    ``fetch_hook(segment, fetch) -> fetch`` wraps the byte-range reads of a segment (instrumentation, fault
    injection). ``decode=False`` moves and verifies the bytes only (``wait_anchor`` and ``residual`` then give
    ``None``): what ``lynxkv stream`` does. ``tee(segment, offset, data)`` sees every block as it arrives, in
    order (to save a copy; commit it only once the load has verified every page). The KV is exactly what
    ``open_cache(...).load_kv()`` gives (:func:`lynxkv.quant.dequantize`, page by page), in ``dtype`` (default
    fp32; with ``exact`` -- ``exact=None``: when the cache has an exact segment -- the cache's own dtype), on
    ``device`` (default the CPU; ``"cuda"``, ``"cuda:1"``, a ``torch.device``; an unknown or missing device is an
    :class:`InputError` raised here, before anything is read). Off the CPU only the page records cross to the
    device, through pinned host memory and asynchronous copies on a stream of the load's own, and are decoded there
    (:mod:`lynxkv.stream.assembly`); the exact stage rebuilds the original tensors on the CPU (its coder runs
    there) from a copy of the full code and hands them out on ``device``.

    ``exact`` adds a third stage: the exact segment, read behind every residual byte (from
    ``exact_file`` when given, else inline or at its recorded location under the same trust rule as the
    residual's), page by page; ``load.exact`` then completes with the original tensors bit for bit (see
    :attr:`ProgressiveLoad.exact`). ``exact=None`` reads it only where the cache has one."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if residual is not None and isinstance(residual, os.PathLike):
        residual = os.fspath(residual)
    if not isinstance(source, str) or not source:
        raise InputError(f"cache source: expected a path or URL, got {source!r}")
    return ProgressiveLoad(source, residual=residual, link=link, on_event=on_event,
                           allow_anchor_only=allow_anchor_only, storage_options=storage_options,
                           inflight=inflight, block_size=block_size, retry=retry, dtype=dtype,
                           fetch_hook=fetch_hook, decode=decode, tee=tee, allow_locations=allow_locations,
                           exact=exact, exact_file=exact_file, room=room, device=device)
