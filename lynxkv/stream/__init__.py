"""Bytes in flight: transports, the emulated link, the progressive reader, tier moves and streamed copies."""

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
