"""The KV a progressive load builds: its output tensors, the anchor code page batch by page batch as the pages
arrive, and the full code layer by layer as each layer's residual is all in, on one thread of the lowest CPU
priority (a model drafting on the anchor meanwhile keeps the cores it uses; what it leaves idle dequantizes the
residual, so little is left to do after the last byte), or at once for a caller that asks for a layer
(:meth:`KVAssembly.full_layer`: the runner's layered verify). A caller that dequantizes the landed layers itself
between its steps holds that worker back (:meth:`KVAssembly.hold`: the runner while it drafts).
The full code's memory pages are mapped while the anchor is on its way (:meth:`KVAssembly.prefault`), so that the
dequantization after it writes into pages the kernel has already provided.

Both are dequantized straight from the page records' bytes (:func:`lynxkv.format.records.dequantize_records`,
compiled passes with the GIL released; the records' own checks run there). A page is exactly P/C whole chunks, so
dequantizing page by page equals dequantizing the whole tensor (:func:`lynxkv.quant.dequantize`).

On another device than the CPU (``device``) the outputs live there and only the page records cross: each call's
records are gathered into one pinned host buffer (:class:`DeviceStaging`), copied with ``non_blocking=True`` and
decoded on the device (the Triton kernels on CUDA), on a CUDA stream of the load's own, so that the copies and
kernels run beside a model's forward on its stream instead of queueing behind it; every call waits for its own
stream before its tensors are handed out, and one thread of the process stages and launches at a time (Triton
compiles a kernel at its first launch, which threads must not do at once). Nothing is copied back to the host.
On the CPU nothing of this applies."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from lynxkv.cache import check_decoded_size
from lynxkv.cache.kv import KVPairs
from lynxkv.errors import LynxError
from lynxkv.format import constants as c
from lynxkv.format.layout import page_tokens
from lynxkv.format.records import dequantize_records, join_records
from lynxkv.quant.dispatch import concurrent_tensors


def lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; Linux, where a thread has its own: elsewhere
    the call would renice the whole process, so nothing is done)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


_LAUNCHES = threading.Lock()  # one thread at a time stages and launches a device decode, across loads


class DeviceStaging:
    """How the page records of a load reach a device other than the CPU: through pinned host memory (where the
    device's backend has it), copied with ``non_blocking=True``, on a CUDA stream of the load's own (:meth:`use`;
    other devices: their current stream). One thread of the process at a time: the first launch of a Triton kernel
    compiles it, which several threads must not do at once (the consumer, the early worker and a runner taking
    layers may all decode)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pinned = True  # until the backend says it has no pinned memory

    @contextlib.contextmanager
    def use(self):
        """The context to copy and decode in: the launch lock, and the load's stream for whichever thread runs it."""
        with _LAUNCHES, (torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()):
            yield

    def wait(self) -> None:
        """Wait until everything issued on the load's stream is done (its outputs may be read on any stream)."""
        if self.stream is not None:
            self.stream.synchronize()

    def copy(self, raws: list) -> tuple[np.ndarray, list[int], torch.Tensor]:
        """``(host bytes, where each record starts in them, their copy on the device)``: the records gathered into
        one pinned buffer, then copied without blocking (the buffer is freed for reuse only once the copy is done:
        torch's pinned-memory cache records the copy's stream)."""
        at = [0]
        for raw in raws[:-1]:
            at.append(at[-1] + len(raw))
        total = at[-1] + len(raws[-1])
        host = None
        if self.pinned:
            try:
                host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # a backend without pinned host memory: pageable, copied the same way
                self.pinned = False
        if host is None:
            host = torch.empty(total, dtype=torch.uint8)
        view = host.numpy()
        for start, raw in zip(at, raws):
            view[start:start + len(raw)] = np.frombuffer(raw, np.uint8)
        return view, at, host.to(self.device, non_blocking=True)


class KVAssembly:
    """The two outputs of one load, allocated from its header: ``anchor`` (anchor-only KV) and ``full``, on
    ``device`` (default the CPU; see the module docstring for another).

    ``room`` > 0: each ``[H, T, D]`` tensor is the front of a buffer of ``T + room`` tokens a head, for a runner's
    cache to grow into in place (:class:`~lynxkv.hf.growing.GrowingLayer`) instead of copying it at its first
    step; the room is never touched here."""

    def __init__(self, header, dtype: torch.dtype, room: int = 0, device: torch.device | None = None):
        check_decoded_size(header, dtype)
        self.header = header
        h, t, d = header.kv_heads, header.tokens, header.head_dim
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.staging = None if self.device.type == "cpu" else DeviceStaging(self.device)

        def out() -> torch.Tensor:
            return torch.empty((h, t + room, d), dtype=dtype, device=self.device)[:, :t, :]

        self.anchor: KVPairs = [(out(), out()) for _ in range(header.layers)]
        self.full: KVPairs = [(out(), out()) for _ in range(header.layers)]
        # Residual pages taken so far, per layer; a layer whose pages are all in becomes a job (its records and
        # its anchor records), run once, by whoever asks first: full_layer, or residual() at the end.
        self._pages = -(-header.tokens // header.scheme.page)
        self._taken: dict[int, list[tuple]] = {}
        self._seen: set[tuple[int, int]] = set()
        self._jobs: dict[int, tuple] = {}
        self._in = [threading.Event() for _ in range(header.layers)]
        self._locks = [threading.Lock() for _ in range(header.layers)]
        self._done = [False] * header.layers
        self.reader = None  # the load's page reader, told when a layer's records are no longer needed
        self.urgent = False  # a caller waits for layers (full_layer): the residual is on its critical path
        # A caller dequantizes the landed layers itself between its steps (take_landed): the early worker would
        # only take a core from those steps (a model's forward waits for its slowest thread), so it leaves them
        self._held = False
        # Layers dequantized as they come in (see the module docstring): one worker of the lowest priority
        self._early: ThreadPoolExecutor | None = None
        self._early_jobs: dict[int, object] = {}  # layer -> its future
        self._early_lock = threading.Lock()  # the consumer's thread and a layered verify's caller both start jobs
        self._closed_early = False  # the early worker was shut down: no more early jobs

    def prefault(self, stop: Callable[[], bool]) -> int:
        """Touch every memory page of the full code's tensors, layer by layer, until ``stop()``; returns how
        many layers it did. A fresh tensor's pages are mapped by the kernel at their first write, which costs
        about as much as the dequantization that writes them (0.24 ms a MB here, against 0.05 for the write
        itself): done while the anchor is on its way, when the cores are idle, that is off the draft window and
        off the verify. Writes one element a page, which the dequantization overwrites (the view's rows only).
        Host memory only: on another device nothing is done."""
        if self.staging is not None:
            return 0
        page = max(1, 4096 // self.full[0][0].element_size())
        done = 0
        for layer, pair in enumerate(self.full):
            if stop():
                break
            with self._locks[layer]:  # never over a layer being dequantized (full_layer holds the lock)
                if self._done[layer]:
                    continue
                for t in pair:
                    for head in t:  # [T, D], contiguous
                        head.view(-1)[::page].zero_()
            done += 1
        return done

    @staticmethod
    def batch_pages(header) -> int:
        """Anchor pages per worker call: about 4 M elements, so that a batch is short next to the load (a close
        waits for the batches under way) and still amortises the call."""
        return max(1, (4 << 20) // max(1, 2 * header.kv_heads * header.scheme.page * header.head_dim))

    def pages(self, layer: int, pages: list[int], anchors: list, residuals: list | None,
              threads: int | None = None) -> None:
        """Dequantize raw records of ``pages`` of one ``layer`` into ``anchor`` (``residuals`` None) or ``full``."""
        h = self.header
        s = h.scheme
        spans = [(p * s.page, page_tokens(h.tokens, s.page, p)) for p in pages]
        out = (self.anchor if residuals is None else self.full)[layer]

        def where(i: int) -> str:
            return f"layer {layer} page {pages[i]}"

        if self.staging is None:
            anchor, anchor_at = join_records(anchors)
            residual, residual_at = (None, None) if residuals is None else join_records(residuals)
            dequantize_records(anchor, anchor_at, residual, residual_at, spans, s, h.kv_heads, h.head_dim, out,
                               where, threads)
            return
        with self.staging.use():  # the copies and the kernels on the load's stream, then waited for
            anchor, anchor_at, anchor_dev = self.staging.copy(anchors)
            residual, residual_at, residual_dev = ((None, None, None) if residuals is None
                                                   else self.staging.copy(residuals))
            dequantize_records(anchor, anchor_at, residual, residual_at, spans, s, h.kv_heads, h.head_dim, out,
                               where, threads, on_device=(anchor_dev, residual_dev))
        self.staging.wait()

    def take(self, items: list[tuple], anchors: dict) -> None:
        """Residual pages taken by the consumer (``("residual", layer, page, raw, n)``, in file order, layer-major);
        a layer whose pages are all in becomes ready for :meth:`full_layer` (its anchor records leave ``anchors``)."""
        for it in items:
            if (it[1], it[2]) in self._seen:  # taken before (residual() hands over every page)
                continue
            self._seen.add((it[1], it[2]))
            pages = self._taken.setdefault(it[1], [])
            pages.append(it)
            if len(pages) == self._pages:
                layer = it[1]
                self._jobs[layer] = (layer, [x[2] for x in pages], [anchors.pop((layer, x[2])) for x in pages],
                                     [x[3] for x in pages])
                del self._taken[layer]
                self._in[layer].set()
                if not (self.urgent or self._held):
                    self._start_early(layer)

    def _start_early(self, layer: int) -> None:
        """Dequantize ``layer`` on the early worker."""
        with self._early_lock:
            if self._closed_early:  # (its jobs may be cancelled: they are not asked for their outcome)
                return
            job = self._early_jobs.get(layer)
            # a job that ran while a caller took the layers did nothing: the layer gets another, once it is let go
            idle = (job is not None and job.done() and not job.cancelled() and job.exception() is None
                    and not self._done[layer])
            if job is not None and not idle:
                return
            if self._early is None:
                self._early = ThreadPoolExecutor(1, thread_name_prefix="lynxkv-residual", initializer=lowest_priority)
            self._early_jobs[layer] = self._early.submit(self._early_layer, layer)

    def hold(self, on: bool) -> None:
        """``on``: the caller takes the landed layers itself between its steps (:meth:`take_landed`), so the early
        worker begins none (one under way finishes); ``False``: it takes them again, those already in first."""
        self._held = on
        if not on and not self.urgent:
            for layer in sorted(self._jobs):
                self._start_early(layer)

    def relax(self) -> None:
        """No caller waits for layers any more (a layered verify was given up): the layers in that nobody has
        begun, and every later one, are dequantized early again."""
        self.urgent = False
        self.hold(False)

    def _early_layer(self, layer: int) -> None:
        if not (self.urgent or self._held):  # a layered verify, or a drafting runner, takes the layers itself
            self.full_layer(layer, threads=1)

    def _end_early(self) -> None:
        """Stop taking layers early (those not begun are cancelled); wait for the one under way (it reads the page
        records)."""
        with self._early_lock:
            early, self._early, self._closed_early = self._early, None, True
        if early is not None:
            early.shutdown(wait=True, cancel_futures=True)

    def release(self) -> None:
        """Let go of the page records still held (a failed or closed load): they may be views of a mapped file."""
        self._end_early()
        self._early_jobs.clear()
        for layer, lock in enumerate(self._locks):
            with lock:
                self._jobs.pop(layer, None)
        self._taken.clear()

    def layer_in(self, layer: int, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for every residual page of ``layer``; True once they are all in."""
        return self._in[layer].wait(timeout)

    def full_layer(self, layer: int, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The full code of ``layer`` (its residual all in: :meth:`layer_in`), dequantized in the calling thread the
        first time it is asked for."""
        with self._locks[layer]:
            if not self._done[layer]:
                job = self._jobs.pop(layer, None)
                if job is None:
                    raise LynxError(f"layer {layer}'s residual is no longer held: the load failed or was closed")
                self._run(layer, job, threads)
        return self.full[layer]

    def _run(self, layer: int, job: tuple, threads: int | None) -> None:
        self.pages(*job, threads=threads)
        self._done[layer] = True
        if self.reader is not None:
            self._drop(layer)

    def all_in(self) -> bool:
        """Whether every layer's residual pages are all in (some may not be dequantized yet). Asked from the last
        layer back: the residual comes layer-major, so until the end the first look answers."""
        return all(e.is_set() for e in reversed(self._in))

    def take_landed(self) -> int:
        """Dequantize, in the calling thread (with its torch threads), every layer whose residual is all in and
        that nobody has begun; a layer another thread holds is left to it, so this never waits. Returns how many
        layers it did. A layer that fails here is put back as it was: the load meets the same error where it
        reports errors (:meth:`residual`), not in the caller."""
        done = 0
        for layer in list(self._jobs):
            lock = self._locks[layer]
            if self._done[layer] or not lock.acquire(blocking=False):
                continue
            try:
                job = self._jobs.pop(layer, None)  # (a layer is done only once its job is taken)
                if job is None:
                    continue
                try:
                    self._run(layer, job, None)
                except Exception:  # noqa: BLE001: reported by residual(), which runs the layer again
                    self._jobs[layer] = job
                    continue
                done += 1
            finally:
                lock.release()
        return done

    def _drop(self, layer: int) -> None:
        for kind in (c.SEGMENT_ANCHOR, c.SEGMENT_RESIDUAL):
            self.reader.drop_layer(kind, layer)

    def residual(self, items: list[tuple], anchors: dict, reader=None) -> None:
        """The full code of every page in ``items`` (``("residual", layer, page, raw, n)``, in file order; the
        pages' anchor records are taken out of ``anchors``), a layer per worker, on threads of the lowest CPU
        priority: a model step under way when the residual lands goes first (its own threads use every core),
        and the decode takes the cores the model leaves while it waits for it. Layers already dequantized by
        :meth:`full_layer` are skipped. ``reader`` (the load's page reader) is told as each layer is done that its
        pages of both segments are no longer needed in memory."""
        if reader is not None:
            self.reader = reader
        self.take(items, anchors)
        layers = sorted({it[1] for it in items})
        self._end_early()  # the layers it has not begun are done below, on every worker
        early, self._early_jobs = self._early_jobs, {}
        failed = {}  # layer -> the error it met early (its records are gone: it is not run again)
        for layer, job in early.items():
            if job.cancelled():
                continue
            if job.exception() is not None:
                failed[layer] = job.exception()
            elif self._done[layer] and self.reader is not None:  # done before the reader was known
                self._drop(layer)
        if self.urgent:  # a layered verify dequantizes layers in order as it reaches them: meet it from the end,
            for layer in reversed(layers):  # at this thread's own priority (a niced worker holding a layer
                if layer in failed:  # the verify waits for would stall behind the model's threads)
                    raise failed[layer]
                self.full_layer(layer, threads=1)
            return
        workers = concurrent_tensors() if self.staging is None else 1  # (a device decodes one call at a time)
        pool = ThreadPoolExecutor(min(workers, len(layers)), thread_name_prefix="lynxkv-residual",
                                  initializer=lowest_priority)
        try:
            jobs = [None if layer in failed else pool.submit(self.full_layer, layer, threads=1) for layer in layers]
            for layer, done in zip(layers, jobs):  # in layer order: the first failing layer's error
                if done is None:
                    raise failed[layer]
                done.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
