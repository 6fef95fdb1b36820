"""The consumer half of the progressive reader (:class:`lynxkv.stream.progressive.ProgressiveLoad`).

One consumer thread per load takes the page records the two parser threads queue, in drain order: anchor pages
first, batch by batch onto the CPU workers as they arrive, ``anchor_ready`` once the last is dequantized; residual
pages held back until then, each layer's full code dequantized once its pages are all in, on one worker of the
lowest CPU priority (a model drafting on the anchor keeps the cores it uses), or by a layered verify that asks for
it first, and what is left once the whole residual is in (:class:`KVAssembly`). It
emits the load's events and ends the load: ``residual`` resolved, or the load failed (:meth:`_fail_all`), or the
residual alone lost under ``allow_anchor_only`` (:meth:`_residual_failed`). docs/tiers.md, "Inside the
progressive reader", says why.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from lynxkv.cache.kv import TORCH_DTYPES
from lynxkv.errors import LynxError
from lynxkv.format import constants as c
from lynxkv.quant.dispatch import concurrent_tensors
from lynxkv.stream.assembly import KVAssembly, lowest_priority
from lynxkv.stream.buffer import StreamClosed
from lynxkv.stream.events import LoadEvent


class LoadConsumer:
    """The consumer thread's side of a :class:`~lynxkv.stream.progressive.ProgressiveLoad`, which derives from it
    and sets up what it reads: the queue (``_queue``: ``(priority, sequence, item)``, 0 for the anchor, 1 for the
    residual), the load's flags and outcome (``_closed``, ``_anchor_done``, ``_residual_go``, ``_future``,
    ``_fatal``, ``_anchor_error``), the residual's page slots, the page reader, the transport, and the plumbing
    (``_emit``, ``_now``, ``_next_seq``), and how many parts still end the load (``_parts_left`` under
    ``_parts_lock``: the consumer, and the exact worker when there is one), and the device the KV goes to
    (``device``). ``_consumer`` is the thread's target;
    ``layer_in`` waits on ``_outputs_ready``, which the consumer sets once it has read the header."""

    def _consumer(self) -> None:
        """Run the consumer loop, then end the load: once the loop's frame is gone, so are its references to the
        page records (views of a mapped file), and closing the transport closes and unmaps the files at once
        rather than at close(), which a caller keeping the KV may never call (the errors the load keeps let go of
        their frames' locals first). The events end after that."""
        try:
            self._consume()
        finally:
            if self._kv is not None:
                self._kv.release()
            failure = self._failure(self._future)
            self._drop_locals(self._fatal, self._anchor_error, failure)
            if failure is not None or self._future.cancelled():
                # The full code failed: the exact stage, which needs it, ends now (its reads fail) rather than
                # once its bytes are in, which they may never be (behind a residual no one reads any more).
                self._transport.close()
            self._part_ended()

    @staticmethod
    def _failure(future) -> BaseException | None:
        return future.exception() if future.done() and not future.cancelled() else None

    @staticmethod
    def _drop_locals(*errors: BaseException | None) -> None:
        """Clear the finished frames in the tracebacks of ``errors`` (and of their causes), which the load keeps
        as its outcome: a page that failed its check was read through the parser's frames, whose locals would
        otherwise keep views of a mapped file, and the file open, for as long as the load is kept."""
        for exc in errors:
            for _ in range(8):  # a chain of causes is short; this bounds a cycle
                if exc is None:
                    break
                traceback.clear_frames(exc.__traceback__)  # a frame still running is left as it is
                exc = exc.__cause__ or exc.__context__

    def _prefault(self, kv: KVAssembly) -> None:
        """Map the full code's memory pages until the anchor is in (or the load closed), at the lowest priority."""
        lowest_priority()
        kv.prefault(lambda: self._anchor_done.is_set() or self._closed.is_set())

    def _part_ended(self) -> None:
        """The consumer or the exact worker is done; the last one closes the transport and ends the events."""
        with self._parts_lock:
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self._transport.close()
            self._log.finish()

    def _consume(self) -> None:
        # No torch.set_num_threads here: it is process-wide (it would also slow down the model decoding beside
        # this load); the dequantization runs in compiled workers, anchor pages on all of them, residual on one.
        # on another device one thread stages and launches every batch (their first launch compiles the kernels)
        workers = concurrent_tensors() if self.device.type == "cpu" else 1
        st = _Consuming(ThreadPoolExecutor(workers, thread_name_prefix="lynxkv-anchor")
                        if self.decode and workers > 1 else None)
        try:
            while True:
                self._anchor_batches_out(st, wait=False)
                _, _, item = self._queue.get()
                if self._consume_item(st, item):
                    return
        except BaseException as exc:  # noqa: BLE001 - e.g. a dequantization failure
            self._fail_all(exc if isinstance(exc, LynxError) else LynxError(f"{type(exc).__name__}: {exc}"))
        finally:
            if st.pool is not None:  # the workers leave the compiled code before the consumer does
                st.pool.shutdown(wait=True, cancel_futures=True)

    def _consume_item(self, st: "_Consuming", item: tuple) -> bool:
        """Act on one queued item; True when the consumer's part of the load is over."""
        kind = item[0]
        if kind == "stop" or self._closed.is_set():
            self._fail_all(StreamClosed("load closed"))
            return True
        if kind == "header":
            self._header_in(st, item[1])
            return False
        if kind == "anchor":
            self._anchor_batch(st, item)
            return False
        if kind == "anchor_done":
            return self._anchor_complete(st)
        if kind == "error":
            return self._segment_failed(st, item)
        return self._residual_item(st, item)

    def _header_in(self, st: "_Consuming", h) -> None:
        """The header: the batch size, the KV being assembled (and the prefault of its full code), and the outputs
        ``layer_in`` may ask for from now on."""
        st.batch_pages = KVAssembly.batch_pages(h)  # an anchor batch is one worker's unit
        if self.decode:
            # with the exact stage (exact=None: where the cache has one), the cache's own dtype
            exact = self.exact_mode or (self.exact_mode is None and h.segment(c.SEGMENT_EXACT))
            dtype = self.dtype or (TORCH_DTYPES[h.dtype] if exact else torch.float32)
            self._kv = KVAssembly(h, dtype, room=self.room, device=self.device)
            # the full code's memory pages mapped while the anchor is on its way (the cores idle), when there is a
            # residual to build it from; joined by close(), like the load's other threads
            if h.segment(c.SEGMENT_RESIDUAL) is not None and self.device.type == "cpu":
                self._prefaulter = threading.Thread(target=self._prefault, args=(self._kv,), daemon=True,
                                                    name="lynxkv-prefault")
                self._prefaulter.start()
        self._outputs_ready.set()  # layer_in may ask the outputs now

    def _anchor_batch(self, st: "_Consuming", item: tuple) -> None:
        """An anchor page and those of its layer queued behind it (up to a batch): dequantized on a worker while
        this thread takes more, or here without workers."""
        batch = [item] + self._take_more(lambda it: it[0] == "anchor" and it[1] == item[1], st.batch_pages - 1)
        if self.decode:
            for _, layer, page, raw, _ in batch:
                st.anchors[(layer, page)] = raw
        args = (item[1], [it[2] for it in batch], [it[3] for it in batch], None)
        if st.pool is not None:  # whole batches on the workers, one thread each; this thread takes more
            st.decoding.append((st.pool.submit(self._kv.pages, *args, threads=1), batch))
            return
        if self.decode:
            self._kv.pages(*args)
        self._anchor_pages_out(batch)

    def _anchor_batches_out(self, st: "_Consuming", wait: bool) -> None:
        """Emit ``anchor_page`` for the batches dequantized so far, in order (all of them: ``wait``); a batch's error
        is raised here."""
        while st.decoding and (wait or st.decoding[0][0].done()):
            future, batch = st.decoding.popleft()
            future.result()
            self._anchor_pages_out(batch)

    def _anchor_pages_out(self, batch: list[tuple]) -> None:
        for _, layer, page, _, n in batch:
            self._emit(LoadEvent("anchor_page", self._now(), layer, page, n))

    def _anchor_complete(self, st: "_Consuming") -> bool:
        """``anchor_done``: the anchor ready once every batch is dequantized, and the residual items held back
        queued again. True when the residual had already failed (the load ends, flagged lossy)."""
        self._anchor_batches_out(st, wait=True)
        self._anchor_kv = self._kv.anchor if self.decode else None
        self._timeline.anchor_ready_s = self._now()
        st.anchor_complete = True
        self._anchor_done.set()
        self._residual_go.set()
        self._emit(LoadEvent("anchor_ready", self._now()))
        if self._future.done():  # the residual already failed
            return True
        for it in st.held:
            self._queue.put((1, it[0], it[1]))
        st.held.clear()
        return False

    def _segment_failed(self, st: "_Consuming", item: tuple) -> bool:
        """A segment failed: the whole load, or the residual alone under ``allow_anchor_only`` (the anchor keeps
        loading; ``anchor_done`` then ends the load, flagged lossy). True when the consumer's part is over."""
        st.residual_held = []  # pages not dequantized yet: the residual failed
        _, segment, exc = item
        if segment == "anchor" or not self.allow_anchor_only:
            self._fail_all(exc)  # without the anchor, or without leave to go lossy, the load fails
            return True
        self._residual_failed(exc)
        for _ in st.held:
            self._residual_slots.release()
        st.held.clear()
        return st.anchor_complete

    def _residual_item(self, st: "_Consuming", item: tuple) -> bool:
        """A residual page or ``residual_done``. Before the anchor is complete it is held back (the paper's drain
        order); after a residual failure it is dropped. True once the full code is resolved or the load failed."""
        kind = item[0]
        if kind == "residual" and self.decode and not self._future.done() and st.anchor_complete:
            # A layer all in is dequantized at the lowest CPU priority (a model drafting on the anchor keeps the
            # cores it uses) or asked for by a layered verify; what is left, at once when all is in.
            taken = [item] + self._take_more(lambda it: it[0] == "residual")
            for _ in taken:
                self._residual_slots.release()
            st.residual_held += taken
            self._kv.take(taken, st.anchors)  # a layer all in can be asked for (full_layer)
            return False
        if kind == "residual_done" and self.decode and not self._future.done() and st.residual_held:
            pages, st.residual_held = st.residual_held, []
            try:  # the records' own checks (padding bits) run here, before the pages are handed on
                self._kv.residual(pages, st.anchors, self._reader)
            except LynxError as exc:
                return self._segment_failed(st, ("error", "residual", exc))
            for _, layer, page, _, n in pages:
                self._emit(LoadEvent("residual_page", self._now(), layer, page, n))
        if not st.anchor_complete:  # residual items wait for the anchor (the paper's drain order)
            st.held.append((self._next_seq(), item))
            return False
        if self._future.done():  # the residual already failed: drop what is still queued
            if kind == "residual":
                self._residual_slots.release()
            return False
        if kind == "residual":  # decode=False: checked only
            _, layer, page, _, n = item
            self._residual_slots.release()
            self._emit(LoadEvent("residual_page", self._now(), layer, page, n))
            return False
        # residual_done: the full code is complete
        full = self._kv.full if self.decode else None
        self._timeline.residual_ready_s = self._now()
        self._future.set_result(full)
        self._emit(LoadEvent("residual_ready", self._now()))
        return True

    def _residual_failed(self, exc: BaseException) -> None:
        if self._future.done():
            return
        self._timeline.residual_failed = str(exc)
        if not self.allow_anchor_only:
            self._fatal = exc
        self._future.set_exception(exc)
        self._emit(LoadEvent("residual_failed", self._now(), message=str(exc)))
        self._transport.abandon_residual(exc)  # stop the residual transport

    def _fail_all(self, exc: BaseException) -> None:
        self._fatal = exc
        if not self._anchor_done.is_set():
            self._anchor_error = exc
            self._anchor_done.set()
        self._residual_go.set()
        if not self._future.done():
            self._timeline.residual_failed = str(exc)
            self._future.set_exception(exc)
        self._emit(LoadEvent("error", self._now(), message=str(exc)))

    # ------------------------------------------------------------------------------------------ KV
    def _take_more(self, fits: Callable[[tuple], bool], limit: int = 64) -> list[tuple]:
        """Further queued items that ``fits`` accepts, in queue order, as many as are already there (at most
        ``limit``): pages that arrived while the last batch was dequantized are dequantized together."""
        got: list[tuple] = []
        while len(got) < limit:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                break
            if not fits(entry[2]):
                self._queue.put(entry)  # same (priority, sequence): its place in the queue is kept
                break
            got.append(entry[2])
        return got


@dataclass
class _Consuming:
    """The consumer loop's state, which lives as long as the loop (its page records are views of mapped files)."""

    pool: ThreadPoolExecutor | None  # the anchor's workers (None: one worker, or nothing decoded)
    batch_pages: int = 64  # an anchor batch, one worker's unit (from the header)
    anchors: dict = field(default_factory=dict)  # (layer, page) -> the anchor page's record, for the residual's
    held: list = field(default_factory=list)  # residual items that came before the anchor was complete
    anchor_complete: bool = False
    decoding: deque = field(default_factory=deque)  # (future, batch) of anchor pages being dequantized, in order
    residual_held: list = field(default_factory=list)  # residual pages taken, dequantized when the last is in
