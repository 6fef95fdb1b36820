"""Scoring codecs against a reference: KV-only scores for a tensor dump, draft scores for a model and prompt.

Per prompt and codec every layer's keys and values are round-tripped once; the same approximate cache then
feeds the KV metrics, the attention error (the window's real queries against the prompt's keys/values) and
one teacher-forced forward of the window (plus one over the text's continuation for the perplexity change).
Results are plain dicts of floats and lists, ready for JSON.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from lynxkv.eval import metrics
from lynxkv.eval.baselines import bits_kv, roundtrip_kv
from lynxkv.eval.draft import Reference, build_reference, forward_logits, window_inputs
from lynxkv.cache.kv import KVPairs

Tick = Callable[[], None]


def roundtrip_cache(codec, kv: KVPairs) -> KVPairs:
    return [(roundtrip_kv(codec, k, "key"), roundtrip_kv(codec, v, "value")) for k, v in kv]


def kv_scores(codec, kv: KVPairs, approx: KVPairs) -> dict:
    """vNMSE (global and per-vector) per layer and averaged over layers, and bits per element."""
    kg = [metrics.vnmse_global(k, kh) for (k, _), (kh, _) in zip(kv, approx)]
    vg = [metrics.vnmse_global(v, vh) for (_, v), (_, vh) in zip(kv, approx)]
    kp = [metrics.vnmse_per_vector(k, kh) for (k, _), (kh, _) in zip(kv, approx)]
    vp = [metrics.vnmse_per_vector(v, vh) for (_, v), (_, vh) in zip(kv, approx)]
    shape = tuple(kv[0][0].shape)
    bits = (bits_kv(codec, shape, "key") + bits_kv(codec, shape, "value")) / 2
    return {
        "bits": bits,
        "k_vnmse": _mean(kg),
        "v_vnmse": _mean(vg),
        "k_vnmse_pv": _mean(kp),
        "v_vnmse_pv": _mean(vp),
        "k_vnmse_layers": kg,
        "v_vnmse_layers": vg,
    }


def exact_attention(ref: Reference) -> list:
    """Per layer, the exact (output, log-weights) of the window's queries over the prompt's cache."""
    return [metrics.attention(q, k, v, ref.scaling) for q, (k, v) in zip(ref.queries, ref.prefix_kv)]


def draft_scores(model, ref: Reference, approx: KVPairs, exact_attn: list | None = None) -> dict:
    """Attention error with the real queries, teacher-forced draft quality and the perplexity change
    on the prompt's continuation."""
    exact_attn = exact_attn if exact_attn is not None else exact_attention(ref)
    rel, akl = [], []
    for q, exact, (kh, vh) in zip(ref.queries, exact_attn, approx):
        r, a = metrics.attention_error_vs(exact, q, kh, vh, ref.scaling)
        rel.append(r)
        akl.append(a)
    logits = forward_logits(model, approx, window_inputs(ref.last_token, ref.tokens))  # [W, V]
    predicted = logits.argmax(-1)
    kl = metrics.next_token_kl(ref.exact_logits, logits)
    out = {
        "attn_err": _mean(rel),
        "attn_kl": _mean(akl),
        "agree": metrics.agreement(ref.tokens, predicted),
        "kl": float(kl.mean()),
        "prefix": metrics.accepted_prefix(ref.tokens, predicted),
    }
    if ref.continuation is not None:
        held = forward_logits(model, approx, window_inputs(ref.last_token, ref.continuation))
        exact_ppl = metrics.perplexity(ref.continuation_exact_logits, ref.continuation)
        out["ppl_exact"] = exact_ppl
        out["ppl_delta"] = metrics.perplexity(held, ref.continuation) / exact_ppl - 1.0
    return out


def score_prompt(model, ids: torch.Tensor, codecs: list, window: int, continuation, tick: Tick | None = None) -> dict:
    """Scores of every codec on one prompt ``ids`` ``[T]`` (``continuation``: the text's next tokens ``[N]`` for
    the perplexity change, or None): ``{codec name: {metric: value}}``."""
    ref = build_reference(model, ids, window, continuation)
    exact_attn = exact_attention(ref)
    scores = {}
    for codec in codecs:
        approx = roundtrip_cache(codec, ref.prefix_kv)
        scores[codec.name] = {**kv_scores(codec, ref.prefix_kv, approx), **draft_scores(model, ref, approx, exact_attn)}
        if tick:
            tick()
    return scores


def score_kv(kv: KVPairs, codecs: list, tick: Tick | None = None) -> dict:
    """KV-only scores of every codec on a cache given as tensors (no model: no draft metrics)."""
    scores = {}
    for codec in codecs:
        scores[codec.name] = kv_scores(codec, kv, roundtrip_cache(codec, kv))
        if tick:
            tick()
    return scores


SCALARS = (
    "bits", "k_vnmse", "v_vnmse", "k_vnmse_pv", "v_vnmse_pv",
    "attn_err", "attn_kl", "agree", "kl", "ppl_delta",
)  # fmt: skip
SPREAD = ("agree", "kl", "ppl_delta")  # reported as mean ± s.e.m. over prompts (and the prefix, below)


def summarize(per_prompt: list[dict], codecs: list, window: int) -> dict:
    """Average per-prompt scores per codec; keep the prefix list, its spread and the survival curve."""
    result = {}
    for codec in codecs:
        rows = [p[codec.name] for p in per_prompt if codec.name in p]
        s: dict = {"description": getattr(codec, "description", codec.name), "prompts": len(rows)}
        for key in SCALARS:
            vals = [r[key] for r in rows if key in r]
            if vals:
                s[key] = _mean(vals)
        for key in SPREAD:  # per prompt, for paired comparisons between codecs, and the spread
            vals = [r[key] for r in rows if key in r]
            if vals:
                s[f"{key}_prompts"] = vals
                s[f"{key}_sem"] = metrics.mean_std(vals)[1] / math.sqrt(len(vals))
        for key in ("k_vnmse_layers", "v_vnmse_layers"):
            if rows and key in rows[0]:
                s[key] = [_mean(list(col)) for col in zip(*(r[key] for r in rows))]
        prefixes = [r["prefix"] for r in rows if "prefix" in r]
        if prefixes:
            mean, std = metrics.mean_std([float(p) for p in prefixes])
            s["prefix_mean"], s["prefix_std"] = mean, std
            s["prefix_sem"] = std / math.sqrt(len(prefixes))
            s["prefixes"] = prefixes
            s["prefix_curve"] = metrics.survival_curve(prefixes, window)
            s["exact_match"] = metrics.exact_match_rate(prefixes, window)
            s["exact_match_16"] = metrics.exact_match_rate(prefixes, min(16, window))
        result[codec.name] = s
    return result


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan
