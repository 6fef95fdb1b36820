"""Tiered storage and progressive streaming of .lynx caches: storage tiers (fsspec), an emulated link with strict
anchor priority, a two-connection TCP transport, and the progressive reader the decode runner consumes."""

from lynxkv.stream.link import EmulatedLink
from lynxkv.stream.tiers import AtomicWriter, copy_segment, read_range, resolve_location, write_bytes_atomic
from lynxkv.stream.units import format_rate, parse_bandwidth, parse_duration

__all__ = [
    "AtomicWriter",
    "EmulatedLink",
    "copy_segment",
    "format_rate",
    "parse_bandwidth",
    "parse_duration",
    "read_range",
    "resolve_location",
    "write_bytes_atomic",
]
