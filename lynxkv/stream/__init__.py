"""Bytes in flight: transports, the progressive reader, tier moves and streamed copies."""

from lynxkv.stream.link import Link
from lynxkv.stream.progressive import LoadEvent, ProgressiveLoad, open_progressive
from lynxkv.stream.tier import move_cache
from lynxkv.stream.units import format_bytes, format_rate, parse_bandwidth, parse_duration

__all__ = [
    "Link",
    "LoadEvent",
    "ProgressiveLoad",
    "format_bytes",
    "format_rate",
    "move_cache",
    "open_progressive",
    "parse_bandwidth",
    "parse_duration",
]
