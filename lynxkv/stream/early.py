"""Reading a remote anchor's pages before its header: what lets a decoder take in a cache still being published.

A publisher (``lynxkv prefill``, :mod:`lynxkv.serve.publish`) writes the anchor file's header and page index last,
since they hold every page's CRC, but its pages as the prefill produces them, and serves each byte once it is
final. A reader that asked for the header first and the pages after it would receive nothing until the whole
anchor is encoded, and then all of it: the prefill's time plus the transfer's. Instead the transport reads the
header's fixed part (96 bytes, which depend on no page: a publisher serves them at once), computes from it where
the first page starts (:func:`lead_of`), and reads the pages from there on (:class:`AheadBlocks`) while it waits for
the header and the index. Nothing is trusted early: the pages are held, never parsed, until the header and the
index arrive and check out, and each page's CRC is checked as before. A cache that is already whole is read the
same way (one request for header and index together, the pages alongside it).
"""

from __future__ import annotations

import collections
import struct
import threading
from typing import Callable, Iterable, Iterator

from lynxkv.errors import FormatError
from lynxkv.format import constants as c
from lynxkv.format.headers import PREFIX_SIZE, anchor_header_length, parse_anchor_header
from lynxkv.storage import RetryPolicy

LEAD_WAIT = 120.0  # seconds a publisher lets a read wait for bytes (lynxkv prefill --wait-timeout's default)
AHEAD_BLOCK = 256 << 10  # bytes per block of the pages read ahead

_FIELDS = struct.Struct("<16xI4xI8xI12xI")  # header_length (16), layers (24), tokens (36), page (52)


def lead_of(fixed: bytes, size: int) -> int | None:
    """Where the anchor's first page starts (``header_length`` + the anchor page index), from the header's fixed
    part, or None when ``fixed`` is short or the numbers it claims do not fit in a file of ``size`` bytes (then
    nothing is read early; the header's own checks report what is wrong)."""
    if len(fixed) < c.ANCHOR_FIXED_SIZE or bytes(fixed[:8]) != c.ANCHOR_MAGIC:
        return None
    header_length, layers, tokens, page = _FIELDS.unpack_from(fixed, 0)
    if not (page and 0 < layers <= c.MAX_LAYERS and tokens <= c.MAX_TOKENS and header_length >= c.ANCHOR_FIXED_SIZE):
        return None
    lead = header_length + c.PAGE_ENTRY_SIZE * layers * -(-tokens // page)
    return lead if lead <= size else None


class AheadBlocks:
    """Iterate ordered ``(offset, data)`` blocks on a thread of its own, holding up to ``cap`` bytes ahead of the
    consumer: a range is read while the consumer waits for something else. :meth:`stop_at` cuts the range short
    (the header said where the anchor ends); the source's error is raised where the consumer reaches it."""

    def __init__(self, blocks: Iterable[tuple[int, bytes]], cap: int = 16 << 20):
        self._source = blocks
        self._held: collections.deque = collections.deque()
        self._bytes = 0
        self._cap = cap
        self._end: int | None = None
        self._done = False
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lynxkv-anchor-ahead")
        self._thread.start()

    def _run(self) -> None:
        try:
            for offset, data in self._source:
                with self._cond:
                    while self._bytes > self._cap and not self._closed:
                        self._cond.wait(0.2)
                    if self._closed or (self._end is not None and offset >= self._end):
                        return
                    self._held.append((offset, data))
                    self._bytes += len(data)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def stop_at(self, end: int) -> None:
        """Deliver nothing at or past ``end``, and ask the source for no more (a :class:`RangeStream`'s end)."""
        with self._cond:
            self._end = end
            if hasattr(self._source, "end"):
                self._source.end = min(self._source.end, end)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        while True:
            with self._cond:
                while not self._held and not self._done and not self._closed:
                    self._cond.wait(0.2)
                if self._held:
                    offset, data = self._held.popleft()
                    self._bytes -= len(data)
                    self._cond.notify_all()
                elif self._error is not None:
                    raise self._error
                else:
                    return
                end = self._end
            if end is not None and offset + len(data) > end:
                if offset >= end:
                    return
                data = data[:end - offset]
            yield offset, data


def early_options(retry: RetryPolicy, block_size: int, lead: bool) -> dict:
    """How the reads of a cache that may be still being published differ from the others. The header and the page
    index (``lead``) are written last, so their read may wait as long as the whole prefill: its stall bound is the
    publisher's own bound on such a wait (:data:`LEAD_WAIT`), not a few seconds. The pages read ahead come in
    smaller blocks, so that a block waiting for a layer still being computed holds up little behind it and
    finishes well within the stall bound."""
    if lead:
        return {"retry": RetryPolicy(retry.attempts, retry.base, retry.cap, max(retry.stall_timeout, LEAD_WAIT))}
    return {"block_size": min(block_size, AHEAD_BLOCK)}


def read_anchor_head(fetch: Callable[[int, int], bytes], size: int,
                     reads: Callable[[int, int, bool], Iterable[tuple[int, bytes]]] | None):
    """``(head, header, end, ahead)`` of an anchor file of ``size`` bytes read with ``fetch(a, b)``: its header
    (``head`` holds it, and with ``ahead`` the page index too), parsed and checked, and where the anchor section ends.
    With ``reads(a, b, lead)`` (the blocks of bytes ``[a, b)``; ``lead``: the header and index, see
    :func:`early_options`), the pages are read from where they start while the header is awaited: ``ahead`` delivers
    them from ``len(head)`` up to ``end`` (None without ``reads`` or when the fixed part gives no plausible start;
    then the caller reads from ``len(head)`` itself)."""
    head = fetch(0, min(c.ANCHOR_FIXED_SIZE if reads is not None else PREFIX_SIZE, size))
    length = anchor_header_length(head, size)
    lead = lead_of(head, size) if reads is not None else None
    ahead = None if lead is None else AheadBlocks(reads(lead, size, False))
    try:
        if lead is not None:
            head = b"".join(data for _, data in reads(0, lead, True))
        elif length > len(head):
            head = fetch(0, length)
        h = parse_anchor_header(head, size)
        end = h.segments[0].offset + h.segments[0].length
        if end > size:
            raise FormatError(f"`file_length` of anchor: expected at least {end} bytes, got {size} (truncated)",
                              field="file_length", where="anchor")
        if lead is not None and lead > end:  # the fixed part said more pages than the segment table holds
            raise FormatError(f"anchor section: ends at byte {end}, before its page index does ({lead})",
                              field="segments[0].length", where="anchor")
    except BaseException:
        if ahead is not None:
            ahead.close()
        raise
    if ahead is not None:
        ahead.stop_at(end)
    return head, h, end, ahead
