"""Tiered storage and progressive streaming of ``.lynx`` caches.

The anchor of a cache can sit on fast storage and arrive first; the residual can sit on slower storage or travel
at low priority. This package makes that real:

Load a cache progressively (the :class:`~lynxkv.loading.CacheLoad` the decode runner consumes)::

    from lynxkv.stream import open_progressive

    load = open_progressive("s3://bucket/x.lynx",            # or a path, file://, http(s)://, memory://,
                            bandwidth="1Gbps", latency="2ms",  # or tcp://HOST:PORT of `lynxkv serve`
                            on_event=print)                   # anchor_page ... anchor_ready, residual_page ...
    draft_kv = load.wait_anchor()            # per layer (K, V) [H, T, D], anchor only (lossy)
    full_kv = load.residual.result()         # anchor + residual, exactly what open_cache(...).load_kv() gives
    load.timeline                            # anchor_ready_s, residual_ready_s, bytes, residual_failed, extra
    for event in load.events(): ...          # the same events as an iterator
    load.close()

Put a segment anywhere (``write_bytes_atomic(url, data)``; ``AtomicWriter`` streams), move segments between
tiers with their checksums checked (``lynxkv.stream.tiermove.move_cache``, ``lynxkv tier``), serve a cache over
two TCP connections with strict anchor priority and DSCP marks (``lynxkv.stream.tcp.CacheServer``,
``lynxkv serve``), and emulate a shared link (``EmulatedLink``).

Modules: ``units`` (1Gbps, 2ms), ``link`` (one token bucket, strict priority), ``tiers`` (fsspec URLs, ranged
reads, atomic writes), ``sources`` (ordered blocks with retries and several reads in flight), ``buffer`` (a
bounded byte source fed by a stream), ``progressive`` (the reader), ``tcp`` (the wire protocol, server, client),
``relocate`` and ``tiermove`` (moving segments), ``report`` (what ``lynxkv stream`` prints).
"""

from lynxkv.stream.link import EmulatedLink
from lynxkv.stream.progressive import LoadEvent, ProgressiveLoad, ResidualUnavailable, open_progressive
from lynxkv.stream.sources import RetryPolicy
from lynxkv.stream.tiermove import move_cache
from lynxkv.stream.tiers import AtomicWriter, read_range, resolve_location, write_bytes_atomic
from lynxkv.stream.units import format_rate, parse_bandwidth, parse_duration

__all__ = [
    "AtomicWriter",
    "EmulatedLink",
    "LoadEvent",
    "ProgressiveLoad",
    "ResidualUnavailable",
    "RetryPolicy",
    "format_rate",
    "move_cache",
    "open_progressive",
    "parse_bandwidth",
    "parse_duration",
    "read_range",
    "resolve_location",
    "write_bytes_atomic",
]
