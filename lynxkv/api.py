"""Task-level functions behind the CLI that need a model or the metrics: encode a model's prefill, measure a
cache's reconstruction error. (Encoding a dump and describing a cache live in :mod:`lynxkv.cache`.)"""

from __future__ import annotations


import torch

from lynxkv.cache import CacheInfo, open_cache, save_cache
from lynxkv.errors import InputError
from lynxkv.eval.metrics import vnmse_global
from lynxkv.dumps import load_kv_safetensors
from lynxkv.kv import KVPairs
from lynxkv.quant.scheme import Scheme


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
    return save_cache(output, kv, scheme, residual_path=residual, single_file=single_file, zstd=zstd,
                      prompt_token_ids=ids.tolist(), model_fingerprint=loaded.fingerprint)


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
