"""Task-level functions behind the CLI, usable directly: encode a dump or a model's prefill, describe a cache,
measure its reconstruction error."""

from __future__ import annotations


import torch

from lynxkv.cache import CacheInfo, LynxCache, encode_kv, open_cache, save_cache
from lynxkv.errors import InputError
from lynxkv.eval.metrics import vnmse_global
from lynxkv.dumps import kv_names, load_kv_safetensors
from lynxkv.kv import KVPairs
from lynxkv.quant.scheme import Scheme


def encode_file(path, output, scheme: Scheme, *, residual=None, single_file=False, zstd=False) -> CacheInfo:
    """Encode a safetensors KV dump into ``output`` (+ residual)."""
    kv, naming = load_kv_safetensors(path)
    if naming.batched:  # keep the [1, H, T, D] shape so that decoding writes it back the same way
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv]
    return save_to_tiers(output, kv, scheme, residual=residual, single_file=single_file, zstd=zstd,
                         names=kv_names(len(kv), naming))


def encode_model(model: str | None, output, scheme: Scheme, *, prompt: str | None = None, tokens: int = 1000,
                 residual=None, single_file=False, zstd=False) -> CacheInfo:
    """Prefill ``model`` on ``prompt`` (default: the built-in prompt of ``tokens`` tokens) and encode its cache,
    with the prompt token ids and the model fingerprint."""
    from lynxkv.hf.models import encode_prompt, load_model, prefill
    from lynxkv.hf.prompts import builtin_prompt

    loaded = load_model(model)
    text = prompt if prompt is not None else builtin_prompt(loaded.tokenizer, tokens)
    ids = encode_prompt(loaded, text)
    kv, _ = prefill(loaded.model, ids)
    return save_to_tiers(output, kv, scheme, residual=residual, single_file=single_file, zstd=zstd,
                         prompt_token_ids=ids.tolist(), model_fingerprint=loaded.fingerprint)


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


def kv_error(full: KVPairs, anchor: KVPairs, original: KVPairs) -> dict:
    if len(original) != len(full) or original[0][0].shape != full[0][0].shape:
        raise InputError(
            f"the original has {len(original)} layers of {tuple(original[0][0].shape)}, the cache "
            f"{len(full)} of {tuple(full[0][0].shape)}"
        )
    rows = []
    for (kf, vf), (ka, va), (k, v) in zip(full, anchor, original):
        rows.append({"key_full": vnmse_global(k, kf), "value_full": vnmse_global(v, vf),
                     "key_anchor": vnmse_global(k, ka), "value_anchor": vnmse_global(v, va)})
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return {"metric": "global vNMSE per layer, mean over layers", "per_layer": rows, "mean": mean}
