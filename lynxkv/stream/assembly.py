"""The KV a progressive load builds: its output tensors, the anchor code page batch by page batch as the pages
arrive, and the full code once the whole residual is in.

Both are dequantized straight from the page records' bytes (:func:`lynxkv.format.records.dequantize_records`,
compiled passes with the GIL released; the records' own checks run there). A page is exactly P/C whole chunks, so
dequantizing page by page equals dequantizing the whole tensor (:func:`lynxkv.quant.dequantize`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from lynxkv.cache import check_decoded_size
from lynxkv.cache.kv import KVPairs
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


class KVAssembly:
    """The two outputs of one load, allocated from its header: ``anchor`` (anchor-only KV) and ``full``."""

    def __init__(self, header, dtype: torch.dtype):
        check_decoded_size(header, dtype)
        self.header = header
        shape = (header.kv_heads, header.tokens, header.head_dim)
        self.anchor: KVPairs = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
                                for _ in range(header.layers)]
        self.full: KVPairs = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
                              for _ in range(header.layers)]

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
        anchor, anchor_at = join_records(anchors)
        residual, residual_at = (None, None) if residuals is None else join_records(residuals)
        dequantize_records(anchor, anchor_at, residual, residual_at,
                           [(p * s.page, page_tokens(h.tokens, s.page, p)) for p in pages], s, h.kv_heads,
                           h.head_dim, (self.anchor if residuals is None else self.full)[layer],
                           lambda i: f"layer {layer} page {pages[i]}", threads)

    def residual(self, items: list[tuple], anchors: dict, reader=None) -> None:
        """The full code of every page in ``items`` (``("residual", layer, page, raw, n)``, in file order; the
        pages' anchor records are taken out of ``anchors``), a layer per worker, on threads of the lowest CPU
        priority: a model step under way when the residual lands goes first (its own threads use every core),
        and the decode takes the cores the model leaves while it waits for it. ``reader`` (the load's page
        reader) is told as each layer is done that its pages of both segments are no longer needed in memory."""
        layers: dict[int, list[tuple]] = {}
        for it in items:
            layers.setdefault(it[1], []).append(it)
        jobs = [(layer, [it[2] for it in batch], [anchors.pop((layer, it[2])) for it in batch],
                 [it[3] for it in batch]) for layer, batch in layers.items()]
        pool = ThreadPoolExecutor(min(concurrent_tensors(), len(jobs)), thread_name_prefix="lynxkv-residual",
                                  initializer=lowest_priority)
        try:
            for done in [pool.submit(self._full_layer, job, reader) for job in jobs]:
                done.result()  # in layer order: the first failing layer's error
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _full_layer(self, job: tuple, reader) -> None:
        layer = job[0]
        self.pages(*job, threads=1)
        if reader is not None:
            for kind in (c.SEGMENT_ANCHOR, c.SEGMENT_RESIDUAL):
                reader.drop_layer(kind, layer)
