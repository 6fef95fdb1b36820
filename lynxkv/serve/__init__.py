"""``lynxkv serve``: one cache over HTTP, the anchor ahead of the residual, fair between clients, bounded."""

from lynxkv.serve.connections import Limits
from lynxkv.serve.egress import Egress
from lynxkv.serve.resources import ServedCache, load_served_cache, parse_dscp
from lynxkv.serve.server import CacheServer, parse_range

__all__ = ["CacheServer", "Egress", "Limits", "ServedCache", "load_served_cache", "parse_dscp", "parse_range"]
