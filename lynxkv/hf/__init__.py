"""The Hugging Face side: model loading, prompts, prefill, and ``transformers`` caches to and from KV pairs."""

from lynxkv.hf.choose import Choice, choose_scheme
from lynxkv.hf.convert import kv_to_cache, to_dynamic_cache
from lynxkv.hf.prefill import continuation_ids, forward, prefill
from lynxkv.cache.kv import cache_to_kv

__all__ = ["Choice", "cache_to_kv", "choose_scheme", "continuation_ids", "forward", "kv_to_cache", "prefill", "to_dynamic_cache"]
