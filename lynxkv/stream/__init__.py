"""Tiered storage and progressive streaming of ``.lynx`` caches.

The anchor of a cache can sit on fast storage and arrive first; the residual can sit on slower storage or travel
at low priority. This package makes that real:

Load a cache progressively (the :class:`~lynxkv.loading.CacheLoad` the decode runner consumes)::

    from lynxkv.stream import open_progressive

    load = open_progressive("s3://bucket/x.lynx",            # or a path, file://, http(s)://, memory://,
                            bandwidth="1Gbps", latency="2ms",  # http://HOST:PORT/x.lynx of `lynxkv serve`,
                                                              # lmcache://MODEL?anchor_path=...&tokens=...
                            on_event=print)                   # anchor_page ... anchor_ready, residual_page ...
    draft_kv = load.wait_anchor()            # per layer (K, V) [H, T, D], anchor only (lossy)
    full_kv = load.residual.result()         # anchor + residual, exactly what open_cache(...).load_kv() gives
    load.timeline                            # anchor_ready_s, residual_ready_s, bytes, residual_failed, extra
    for event in load.events(): ...          # the same events as an iterator
    load.close()

Move segments between tiers with their checksums checked (``lynxkv.stream.tier.move_cache``, ``lynxkv tier``),
save a streamed copy (``lynxkv.stream.received.ReceivedCopy``, ``lynxkv stream -o``), serve a cache over HTTP
with strict anchor priority, fairness between clients and DSCP marks (``lynxkv.stream.http_server.CacheServer``,
``lynxkv serve``), and emulate a shared link (``EmulatedLink``). Bytes at rest (paths, URLs, ranged reads, atomic writes, locations) are
the storage layer's, :mod:`lynxkv.storage`.

Modules: ``units`` (1Gbps, 2ms, sizes), ``link`` (one token bucket, strict priority), ``buffer`` (a bounded byte
source fed by a stream), ``transport`` (how segment bytes arrive: ranged reads through the storage layer, and
the interface a new transport implements), ``joined`` (several stored caches read as one, along tokens),
``progressive`` (the consumer: priority, events, ETA, pages,
dequantization), ``http_server`` (``lynxkv serve``), ``tier`` (moving segments), ``received`` (saving a
streamed copy), ``report`` (what ``lynxkv stream`` prints).
"""

from lynxkv.stream.link import EmulatedLink
from lynxkv.stream.progressive import LoadEvent, ProgressiveLoad, open_progressive
from lynxkv.stream.tier import move_cache
from lynxkv.stream.units import format_bytes, format_rate, parse_bandwidth, parse_duration

__all__ = [
    "EmulatedLink",
    "LoadEvent",
    "ProgressiveLoad",
    "format_bytes",
    "format_rate",
    "move_cache",
    "open_progressive",
    "parse_bandwidth",
    "parse_duration",
]
