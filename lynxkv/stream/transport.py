"""Transports: how a cache's segment bytes reach the progressive reader.

The progressive reader (:mod:`lynxkv.stream.progressive`) parses pages from byte sources that fill in the
background; a transport (:class:`Transport`) makes those sources. ``open_residual`` returns a buffer whose offsets
are those of the object holding the residual: from 0 for an external residual file, from the section's offset
inside the anchor file for an inline one (``buffer.base``); ``open_exact`` (optional) the same for the exact
segment, whose bytes go behind the residual's. Both return at once; a pump thread feeds the buffer. A transport
reports what it moved through :class:`Transfer` (bytes per stream, first-byte times, a ``tee`` of every block,
retries) and charges the shared :class:`~lynxkv.stream.link.Link` if there is one: the easiest way to do
both is to turn the wire into ordered ``(offset, bytes)`` blocks and hand them to :meth:`Transfer.pump`.

:func:`open_transport` picks the transport registered for a URL's scheme (:func:`register_transport`, or a
package's ``lynxkv.transports`` entry point), else :class:`StorageTransport` (every path and URL the storage layer
opens: local files, ``s3://``, ``http(s)://``, ``memory://``), which reads both segments as block streams of
ranged reads (:class:`lynxkv.stream.range_stream.RangeStream`: reads in flight, retries, the stall bound).
"""

from __future__ import annotations

import importlib.metadata
import threading
import time
from typing import Callable, Iterable, Protocol

from lynxkv.errors import LynxError, ResidualUnavailable
from lynxkv.format import constants as c
from lynxkv.format.headers import AnchorHeader
from lynxkv.cache.loading import LoadTimeline
from lynxkv.storage import (
    FileSource,
    RetryPolicy,
    is_local,
    local_path,
    protocol_of,
    read_range,
    resolve_location,
    retried,
    size_of,
)
from lynxkv.stream.buffer import InPlaceBuffer, StreamBuffer, StreamClosed
from lynxkv.stream.early import early_options, read_anchor_head
from lynxkv.stream.link import ANCHOR, EXACT, RESIDUAL, STREAMS, Link
from lynxkv.stream.range_stream import Fetch, RangeStream


class Transfer:
    """What a transport moved, and the plumbing every transport shares: pumps, the link, the tee, closing.

    ``timeline`` gets the byte counts and the first-byte times (``extra["anchor_first_s"]`` ...) and the retry
    messages (``extra["retries"]``); ``tee(segment, offset, data)`` sees every block in order."""

    def __init__(self, timeline: LoadTimeline, now: Callable[[], float], *, link: Link | None = None,
                 tee: Callable[[str, int, bytes], None] | None = None):
        self.timeline = timeline
        self.now = now
        self.link = link
        self.tee = tee
        self.anchor_fetched = threading.Event()  # every anchor byte is in (set by the anchor's pump)
        self.residual_fetched = threading.Event()  # every residual byte is in, or the residual stream ended
        self.residual_started_at: float | None = None  # perf_counter of the first residual byte
        self.closed = threading.Event()
        self._buffers: list[StreamBuffer | InPlaceBuffer] = []
        self.in_place_names: set[str] = set()  # the streams read in place (no arrival rate to measure)
        self._closers: list[Callable[[], None]] = []

    def on_retry(self, msg: str) -> None:
        self.timeline.extra["retries"].append(msg)

    def add_closer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the transfer closes (at once if it already has)."""
        self._closers.append(fn)
        if self.closed.is_set():
            fn()

    def buffer(self, size: int, name: str, *, base: int = 0) -> StreamBuffer:
        buf = StreamBuffer(size, name, base=base)
        self._buffers.append(buf)
        return buf

    def in_place(self, source: FileSource, name: str, stream: int, *, base: int = 0) -> InPlaceBuffer:
        """A buffer over a file already in hand, read in place: its bytes count as arrived as the reader reaches
        them. Closing the load fails its reads (the transport that opened ``source`` closes it)."""
        buf = InPlaceBuffer(source, name, base=base,
                            on_read=lambda offset, data: self.received(stream, name, offset, data))
        self._buffers.append(buf)
        self.in_place_names.add(name)
        if self.closed.is_set():
            buf.fail(StreamClosed("load closed"))
        return buf

    def received(self, stream: int, name: str, offset: int, data: bytes) -> None:
        """Account for one block (and show it to the tee)."""
        if self.timeline.extra.get(f"{name}_first_s") is None:
            self.timeline.extra[f"{name}_first_s"] = self.now()
        if self.tee is not None:
            self.tee(name, offset, data)
        if stream == ANCHOR:
            self.timeline.anchor_bytes += len(data)
        elif stream == RESIDUAL:
            if self.residual_started_at is None:
                self.residual_started_at = time.perf_counter()
            self.timeline.residual_bytes += len(data)
        else:  # the exact segment
            self.timeline.extra["exact_bytes"] = self.timeline.extra.get("exact_bytes", 0) + len(data)

    def pump(self, blocks: Iterable[tuple[int, bytes]], buf: StreamBuffer, stream: int, name: str, *,
             charge_link: bool) -> threading.Thread:
        """Move ordered blocks into ``buf`` on a thread of its own (charging the link when the blocks have not
        been charged already, as :class:`RangeStream` does)."""

        def run() -> None:
            first = True
            try:
                for offset, data in blocks:
                    if self.closed.is_set():
                        return
                    if charge_link and self.link is not None:
                        self.link.send(stream, len(data))  # blocks for the serialisation of these bytes
                        if first and self.link.latency:
                            # A pipe: the first byte arrives `latency` after it left, and the rest follow at
                            # the link rate, so a continuous stream pays the latency once, not per block.
                            time.sleep(self.link.latency)
                    first = False
                    self.received(stream, name, offset, data)
                    buf.feed(offset, data)
                buf.finish()
            except BaseException as exc:  # noqa: BLE001
                buf.fail(exc if isinstance(exc, LynxError) else LynxError(f"{buf.name}: {exc}"))
            finally:
                if stream == ANCHOR:
                    self.anchor_fetched.set()
                elif stream == RESIDUAL:
                    self.residual_fetched.set()

        t = threading.Thread(target=run, daemon=True, name=f"lynxkv-pump-{buf.name}")
        t.start()
        return t

    def close(self) -> None:
        self.closed.set()
        for b in self._buffers:
            b.fail(StreamClosed("load closed"))
        for fn in self._closers:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass


class Transport(Protocol):
    """What the progressive reader uses of a transport (the module docstring says how the offsets run)."""

    residual_url: str | None  # where the residual came from (for reports), once known
    anchor_size: int | None  # bytes of the anchor to transfer, once known

    def open_anchor(self) -> StreamBuffer: ...  # the anchor file's bytes, from offset 0
    def open_residual(self, header: AnchorHeader) -> StreamBuffer: ...  # the residual section's bytes
    def abandon_residual(self, exc: BaseException) -> None: ...  # stop moving residual bytes
    def close(self) -> None: ...  # stop everything, fail waiting readers


class StorageTransport:
    """Both segments by ranged reads through the storage layer (any path or URL it opens).

    The anchor: its header first (two small reads) to learn where the anchor section ends, then the section in
    blocks. The residual: from ``residual``, or from the location the header records under the trust rule of
    :func:`lynxkv.storage.resolve_location` (``allow_locations``); it keeps one request in flight until every anchor byte is in, so on a shared store it does
    not slow the anchor down (strict priority at the storage too, not only on the link), and under an emulated
    link its first byte goes on the link after the anchor's last (the receiver drains the anchor first), so a
    moment in which no anchor block happens to be waiting does not let a residual block in ahead of it.

    A local file read with nothing in between (no emulated link, no fetch hook, no tee) is not moved at all: it is
    memory-mapped and its pages are read in place (:class:`~lynxkv.stream.buffer.InPlaceBuffer`), as
    ``open_cache`` reads them: reaching anchor-ready costs the reads, checks and dequantization of an anchor-only
    ``load_kv`` plus the reader's threads and per-page events, without a block pump, a stream buffer or a copy of
    every page."""

    def __init__(self, url: str, transfer: Transfer, *, residual: str | None = None,
                 storage_options: dict | None = None, inflight: int = 4, block_size: int = 1 << 20,
                 retry: RetryPolicy | None = None, fetch_hook: Callable[[str, Fetch], Fetch] | None = None,
                 allow_locations=()):
        self.url = url
        self.allow_locations = tuple(allow_locations)
        self.transfer = transfer
        self.residual_override = residual
        self.storage_options = storage_options
        self.inflight, self.block_size = inflight, block_size
        self.retry = retry or RetryPolicy()
        self.fetch_hook = fetch_hook
        self.residual_url: str | None = None
        self.exact_url: str | None = None
        self.anchor_size: int | None = None
        self._size = 0
        self._residual_buf: StreamBuffer | InPlaceBuffer | None = None
        self._anchor_src: FileSource | None = None

    def _in_place(self, url: str) -> bool:
        """Whether ``url`` is read in place: a local file, and nothing to do with its bytes on the way."""
        t = self.transfer
        return is_local(url) and t.link is None and self.fetch_hook is None and t.tee is None

    def _blocks(self, url: str, start: int, end: int, stream: int, name: str, *, link: bool = True,
                fetch: Fetch | None = None, **options) -> RangeStream:
        """Bytes ``[start, end)`` of ``url`` in blocks (or of ``fetch``; ``options``: another block size, retry)."""
        if self.fetch_hook is not None:
            fetch = self.fetch_hook(name, fetch or (lambda a, b: read_range(url, a, b, self.storage_options)))
        t = self.transfer
        src = RangeStream(url, start, end, stream=stream, segment=name, link=t.link if link else None, fetch=fetch,
                          **{"block_size": self.block_size, "inflight": self.inflight, "retry": self.retry, **options},
                          storage_options=self.storage_options, on_retry=t.on_retry,
                          after={ANCHOR: None, RESIDUAL: t.anchor_fetched, EXACT: t.residual_fetched}[stream])
        t.add_closer(src.close)
        return src

    def _size_of(self, url: str) -> int:
        """The size of ``url`` (over HTTP a ``HEAD``, which a publisher answers at once), with the block reads'
        retries and stall bound: a server that takes the request and answers nothing is given up on as a stalled
        read is."""
        return retried(lambda: size_of(url, self.storage_options), self.retry, f"the size of {url}")

    def _fetch_exact(self, a: int, b: int) -> bytes:
        """One small ranged read of the anchor (the header), with the same retries as the block streams."""
        return b"".join(data for _, data in self._blocks(self.url, a, b, ANCHOR, "anchor", link=False))

    def open_anchor(self) -> StreamBuffer | InPlaceBuffer:
        t = self.transfer
        if self._in_place(self.url):
            src = self._anchor_src = FileSource(local_path(self.url))
            t.add_closer(src.close)
            size, fetch = src.size, (lambda a, b: src.read(a, b - a))
        else:
            size, fetch = self._size_of(self.url), self._fetch_exact
        self._size = self.anchor_size = size
        http = self._anchor_src is None and protocol_of(self.url) in ("http", "https")
        head, h, end, ahead = read_anchor_head(fetch, size, (lambda a, b, lead: self._blocks(  # see stream.early
            self.url, a, b, ANCHOR, "anchor", link=not lead, **early_options(self.retry, self.block_size, lead)))
            if http else None)
        if ahead is not None:
            t.add_closer(ahead.close)
        self.anchor_size = end  # a single file's inline residual is the residual stream's
        if self._anchor_src is not None:
            t.anchor_fetched.set()  # every anchor byte is in hand: nothing for the residual to yield to
            return t.in_place(self._anchor_src, "anchor", ANCHOR)
        buf = t.buffer(size, "anchor")
        if t.link is not None:
            t.link.send(ANCHOR, len(head))
        t.received(ANCHOR, "anchor", 0, head)
        buf.feed(0, head)
        blocks = ahead if ahead is not None else self._blocks(self.url, len(head), end, ANCHOR, "anchor")
        t.pump(blocks, buf, ANCHOR, "anchor", charge_link=False)
        return buf

    def open_residual(self, header: AnchorHeader) -> StreamBuffer | InPlaceBuffer:
        seg = header.segment(c.SEGMENT_RESIDUAL)
        t = self.transfer
        if seg.placement == c.PLACEMENT_INLINE and self._anchor_src is not None:
            self.residual_url = self.url
            t.residual_fetched.set()  # in hand: nothing for the exact segment to yield to
            buf = self._residual_buf = t.in_place(self._anchor_src, "residual", RESIDUAL, base=seg.offset)
            return buf
        if seg.placement == c.PLACEMENT_INLINE:
            self.residual_url = self.url
            buf = t.buffer(self._size, "residual", base=seg.offset)
            t.pump(self._blocks(self.url, seg.offset, seg.offset + seg.length, RESIDUAL, "residual"), buf,
                   RESIDUAL, "residual", charge_link=False)
        else:
            url = self.residual_override or resolve_location(self.url, seg.location, allow=self.allow_locations)
            self.residual_url = url
            buf = self._side_buffer(url, seg, RESIDUAL)
        self._residual_buf = buf
        return buf

    def _side_buffer(self, url: str, seg, stream: int) -> StreamBuffer | InPlaceBuffer:
        """The buffer of a side segment in a file of its own at ``url`` (read in place, or pumped)."""
        t, name = self.transfer, STREAMS[stream]
        if self._in_place(url):  # the page reader checks its length against the header
            src = FileSource(local_path(url))
            t.add_closer(src.close)
            if stream == RESIDUAL:
                t.residual_fetched.set()
            return t.in_place(src, name, stream)
        size = self._size_of(url)
        buf = t.buffer(size, name)
        if size == seg.length:
            t.pump(self._blocks(url, 0, size, stream, name), buf, stream, name, charge_link=False)
        else:
            if stream == RESIDUAL:
                t.residual_fetched.set()
            buf.finish()  # the page reader reports the length mismatch (truncated / trailing)
        return buf

    def open_exact(self, header: AnchorHeader, override: str | None = None) -> StreamBuffer | InPlaceBuffer:
        """The exact segment's bytes, behind every residual byte: inline in the anchor file, or at
        ``override``, or at the location the header records under the trust rule (``allow_locations``)."""
        seg = header.segment(c.SEGMENT_EXACT)
        t = self.transfer
        if seg.placement == c.PLACEMENT_INLINE:
            self.exact_url = self.url
            if self._anchor_src is not None:
                return t.in_place(self._anchor_src, "exact", EXACT, base=seg.offset)
            buf = t.buffer(self._size, "exact", base=seg.offset)
            t.pump(self._blocks(self.url, seg.offset, seg.offset + seg.length, EXACT, "exact"), buf, EXACT, "exact",
                   charge_link=False)
            return buf
        url = override or resolve_location(self.url, seg.location, allow=self.allow_locations, what="exact segment")
        self.exact_url = url
        return self._side_buffer(url, seg, EXACT)

    def abandon_residual(self, exc: BaseException) -> None:
        self.transfer.residual_fetched.set()  # the exact segment need not wait for it any longer
        if self._residual_buf is not None:
            self._residual_buf.fail(ResidualUnavailable("residual abandoned"))

    def close(self) -> None:
        self.transfer.close()


#: Transports by URL scheme; anything else goes through the storage layer (:class:`StorageTransport`).
TRANSPORTS: dict[str, Callable[..., Transport]] = {}
#: Packages register the transports of their own schemes as entry points of this group (lynxkv's LMCache
#: integration does, in pyproject.toml), loaded on first use: streaming never imports a package it was not asked for.
ENTRY_POINT_GROUP = "lynxkv.transports"


def register_transport(scheme: str, factory: Callable[..., Transport]) -> None:
    """Read ``scheme://`` URLs with ``factory(url, transfer, **options)``."""
    TRANSPORTS[scheme.lower()] = factory


def transport_for(url: str) -> Callable[..., Transport] | None:
    """The transport registered for ``url``'s scheme (loading a package's entry point on first use), or None: the
    storage layer reads it."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme and scheme not in TRANSPORTS:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=scheme):
            register_transport(scheme, ep.load())
            break
    return TRANSPORTS.get(scheme)


def open_transport(url: str, transfer: Transfer, **options) -> Transport:
    return (transport_for(url) or StorageTransport)(url, transfer, **options)
