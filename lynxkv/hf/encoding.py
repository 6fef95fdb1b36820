"""Encode a model's cache: prefill a prompt, choose the anchor on the cache, and save it with the model's identity."""

from __future__ import annotations

import torch

from lynxkv.hf.choose import choose_scheme
from lynxkv.hf.prefill import prefill


def encode_model(model: str | None, output, candidates, *, prompt: str | None = None, tokens: int = 1000,
                 residual=None, single_file=False, zstd=False, dtype: torch.dtype | str = "auto", exact=False,
                 exact_path=None):
    """Prefill ``model`` (loaded in ``dtype``; ``"auto"``: its own, the cache stores the KV it produces) on
    ``prompt`` (default: the built-in prompt of ``tokens`` tokens) and encode its cache with the scheme of
    ``candidates`` (a sequence of schemes) whose anchor the model scores best on the cache
    (:func:`lynxkv.hf.choose.choose_scheme`; one candidate: that scheme), with the prompt token ids, the model
    fingerprint and the model's name (properties :data:`~lynxkv.hf.models.MODEL_PROPERTY`,
    :data:`~lynxkv.hf.models.DTYPE_PROPERTY`, ...). Returns the cache's ``CacheInfo`` and the
    :class:`~lynxkv.hf.choose.Choice`. ``exact``/``exact_path``: an exact segment too, as
    :func:`lynxkv.cache.save_cache` writes it."""
    from lynxkv.cache import save_cache
    from lynxkv.hf.models import encode_prompt, load_model, model_properties
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.quant.scheme import Scheme

    loaded = load_model(model, dtype=dtype)
    text = prompt if prompt is not None else builtin_prompt(loaded.tokenizer, tokens)
    ids = encode_prompt(loaded, text)
    kv, _ = prefill(loaded.model, ids)
    choice = choose_scheme(loaded.model, ids, kv, (candidates,) if isinstance(candidates, Scheme) else tuple(candidates))
    info = save_cache(output, kv, choice.scheme, residual_path=residual, single_file=single_file, zstd=zstd,
                      prompt_token_ids=ids.tolist(), model_fingerprint=loaded.fingerprint,
                      properties=model_properties(loaded), exact=exact, exact_path=exact_path)
    return info, choice
