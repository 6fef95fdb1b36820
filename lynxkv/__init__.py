"""lynxkv: progressive, tiered KV-cache storage and transfer for LLM inference: anchor first, exact output."""

from lynxkv.cache import (CacheInfo, EncodedCache, LynxCache, encode_kv, open_cache, save_cache, save_cache_layers,
                          verify_file)
from lynxkv.errors import ChecksumError, FormatError, InputError, LynxError, SchemeError
from lynxkv.quant.scheme import DEFAULT, PAPER, PRESETS, Scheme, get_scheme

__version__ = "0.1.0"

__all__ = [
    "CacheInfo",
    "EncodedCache",
    "LynxCache",
    "encode_kv",
    "open_cache",
    "save_cache",
    "save_cache_layers",
    "verify_file",
    "DEFAULT",
    "PAPER",
    "PRESETS",
    "ChecksumError",
    "FormatError",
    "InputError",
    "LynxError",
    "Scheme",
    "SchemeError",
    "get_scheme",
]
