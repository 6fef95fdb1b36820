"""When each layer's residual bytes arrived, for the run's timeline (``timeline.extra["residual_layers"]``).

A :class:`ArrivalTransfer` is the progressive reader's :class:`~lynxkv.stream.transport.Transfer` that also notes
the end offset and time of every residual block as it arrives (a block is 1 MiB, so a few dozen notes for a
whole residual). :func:`layer_arrivals` turns those notes and the residual's page index (layer-major, absolute
spans in the object holding the residual) into one row per layer: the time its last byte had arrived and how many
residual bytes had arrived by then. A residual read in place counts its bytes as they are parsed.
"""

from __future__ import annotations

import bisect
import threading
import time

from lynxkv.stream.link import RESIDUAL
from lynxkv.stream.transport import Transfer


class ArrivalTransfer(Transfer):
    """A :class:`Transfer` that keeps ``(seconds since the load started, end offset, bytes so far)`` per residual
    block."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_byte_at: float | None = None  # perf_counter of the load's first block, either stream
        self.first_block = 0  # its bytes: they were in flight before the clock started, so no rate counts them
        self.residual_blocks: list[tuple[float, int, int]] = []
        self._lock = threading.Lock()

    def residual_eta(self, total: int | None, anchor_left: int) -> float | None:
        """Seconds until the last of ``total`` residual bytes arrives (``anchor_left`` anchor bytes still ahead of
        it), from the bytes seen arriving so far: what is left over the rate observed since the first block arrived,
        counting the bytes that came after it (a block arrives whole: counted, the first block's bytes would make
        an anchor that came as one block look instantaneous). An emulated link's configured rate is never read: a
        real link tells nobody its rate. None while unknown (nothing after the first block yet), and for a residual
        read in place (its bytes arrive as they are parsed)."""
        if total is None or "residual" in self.in_place_names:
            return None
        got = self.timeline.residual_bytes
        if "anchor" in self.in_place_names:  # the anchor's bytes came at the disk's speed: the residual's own rate
            first, seen = self.residual_started_at, got
        else:
            first, seen = self.first_byte_at, self.timeline.anchor_bytes + got - self.first_block
        if first is None or seen <= 0:
            return None
        elapsed = time.perf_counter() - first
        if elapsed <= 0:
            return None
        return (anchor_left + max(0, total - got)) / (seen / elapsed)

    def received(self, stream: int, name: str, offset: int, data: bytes) -> None:
        if self.first_byte_at is None:
            self.first_byte_at, self.first_block = time.perf_counter(), len(data)
        super().received(stream, name, offset, data)
        if stream == RESIDUAL:
            with self._lock:
                self.residual_blocks.append((self.now(), offset + len(data), self.timeline.residual_bytes))


def layer_arrivals(blocks: list[tuple[float, int, int]], index) -> list[dict]:
    """``[{"layer", "arrived_s", "bytes"}]``: when the last byte of each layer of ``index`` (a residual
    :class:`~lynxkv.format.reader.SectionIndex`) had arrived, from the ``blocks`` an :class:`ArrivalTransfer`
    noted (in arrival order, so in offset order); layers whose end has not arrived are left out."""
    per = max(index.pages_per_layer, 1)
    layers = len(index.entries) // per
    ends = [max(index.span(layer, p)[0] + index.span(layer, p)[1] for p in range(per)) for layer in range(layers)]
    reached, rows = [b[1] for b in blocks], []
    running = 0
    for i, end in enumerate(reached):  # offsets only grow within one stream; guard against a retry's repeat
        running = max(running, end)
        reached[i] = running
    for layer, end in enumerate(ends):
        j = bisect.bisect_left(reached, end)
        if j == len(blocks):
            break
        rows.append({"layer": layer, "arrived_s": blocks[j][0], "bytes": blocks[j][2]})
    return rows
