"""The cache API: KV tensors to a ``.lynx`` cache and back (encode, save, open, read, verify)."""

from lynxkv.cache.encoded import EncodedCache, encode_kv
from lynxkv.cache.opened import (
    MAX_DECODED_ENV,
    CacheInfo,
    LynxCache,
    check_decoded_size,
    default_window,
    max_decoded_bytes,
    open_cache,
    verify_file,
    window_for_memory,
)
from lynxkv.cache.save import (default_exact_path, default_residual_path, exact_file_of, residual_file_of, save_cache,
                               save_cache_layers, save_dump)

__all__ = [
    "MAX_DECODED_ENV",
    "CacheInfo",
    "EncodedCache",
    "LynxCache",
    "check_decoded_size",
    "default_window",
    "default_exact_path",
    "default_residual_path",
    "encode_kv",
    "exact_file_of",
    "max_decoded_bytes",
    "open_cache",
    "residual_file_of",
    "save_cache",
    "save_cache_layers",
    "save_dump",
    "verify_file",
    "window_for_memory",
]
