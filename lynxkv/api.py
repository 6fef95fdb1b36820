"""Task-level functions behind the CLI, usable directly: encode a dump, describe a cache, measure its
reconstruction error."""

from __future__ import annotations

import torch

from lynxkv.cache import CacheInfo, LynxCache, encode_kv, open_cache, save_cache
from lynxkv.eval.metrics import kv_error
from lynxkv.dumps import kv_names, load_kv_safetensors
from lynxkv.quant.scheme import Scheme


def encode_file(path, output, scheme: Scheme, *, residual=None, single_file=False, zstd=False) -> CacheInfo:
    """Encode a safetensors KV dump into ``output`` (+ residual)."""
    kv, naming = load_kv_safetensors(path)
    if naming.batched:  # keep the [1, H, T, D] shape so that decoding writes it back the same way
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv]
    return save_to_tiers(output, kv, scheme, residual=residual, single_file=single_file, zstd=zstd,
                         names=kv_names(len(kv), naming))


def save_to_tiers(output, kv, scheme: Scheme, *, residual: str | None = None, single_file: bool = False,
                  zstd: bool = False, **meta) -> CacheInfo:
    """:func:`~lynxkv.cache.save_cache`, except that the residual may go to any fsspec URL (``s3://``,
    ``memory://`` ...): it is written there first (one atomic PUT), then the anchor, which records the URL."""
    if residual is None or "://" not in residual:
        return save_cache(output, kv, scheme, residual_path=residual, single_file=single_file, zstd=zstd, **meta)
    from lynxkv.format.writer import build_files, write_atomic
    from lynxkv.stream.tiers import write_bytes_atomic

    built = build_files(encode_kv(kv, scheme, **meta), residual_location=residual, zstd=zstd)
    write_bytes_atomic(residual, built.residual)
    write_atomic(output, built.anchor)
    with open_cache(output) as cache:
        return cache.info


def describe(cache: LynxCache) -> dict:
    """What ``lynxkv inspect --json`` prints (stable keys: tokens, layers, kv_heads, head_dim, scheme,
    bits_per_element.total / .anchor, prompt_token_ids when stored)."""
    d = cache.info.to_dict()
    d["scheme_description"] = cache.info.scheme.describe()
    d["residual_reachable"] = cache.residual_reachable()
    if not d.get("prompt_token_ids"):
        d.pop("prompt_token_ids", None)
    return d


def reconstruction_error(cache_path, original_path, *, residual=None) -> dict:
    """vNMSE per layer of keys and values, full and anchor-only, against the original dump, and the means."""
    original, _ = load_kv_safetensors(original_path)
    with open_cache(cache_path, residual=residual) as c:
        return kv_error(c.load_kv(dtype=torch.float32), c.load_kv(anchor_only=True, dtype=torch.float32), original)
