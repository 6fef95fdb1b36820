"""Scoring codecs against a reference: KV-only scores for a tensor dump, draft scores for a model and prompt.

Per prompt, window and codec every layer's keys and values are round-tripped once; the same approximate cache
then feeds the KV metrics (first window: the prompt's own KV), the attention error (the window's real queries
against its context's keys/values), one teacher-forced forward of the window and the accepted prefix
(:mod:`lynxkv.eval.windows`), plus, on the first window, one forward over the text's continuation for the
perplexity change. Results are plain dicts of floats and lists, ready for JSON.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from lynxkv.errors import InputError
from lynxkv.eval import metrics, windows
from lynxkv.eval.baselines import bits_kv, roundtrip_cache
from lynxkv.eval.draft import Reference, build_reference, extend_kv, forward_logits, window_inputs
from lynxkv.cache.kv import KVPairs

Tick = Callable[[], None]


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


def draft_scores(model, ref: Reference, approx: KVPairs, exact_attn: list | None = None,
                 logits: torch.Tensor | None = None) -> dict:
    """Attention error with the real queries, teacher-forced draft quality (``logits`` ``[W, V]``: the forward of
    the window on ``approx``, computed here when not given) and, where ``ref`` has a continuation, the perplexity
    change on it."""
    exact_attn = exact_attn if exact_attn is not None else exact_attention(ref)
    rel, akl = [], []
    for q, exact, (kh, vh) in zip(ref.queries, exact_attn, approx):
        r, a = metrics.attention_error_vs(exact, q, kh, vh, ref.scaling)
        rel.append(r)
        akl.append(a)
    if logits is None:
        logits = forward_logits(model, approx, window_inputs(ref.last_token, ref.tokens))  # [W, V]
    kl = metrics.next_token_kl(ref.exact_logits, logits)
    out = {
        "attn_err": _mean(rel),
        "attn_kl": _mean(akl),
        "agree": metrics.agreement(ref.tokens, logits.argmax(-1)),
        "kl": float(kl.mean()),
    }
    if ref.continuation is not None:
        held = forward_logits(model, approx, window_inputs(ref.last_token, ref.continuation))
        exact_ppl = metrics.perplexity(ref.continuation_exact_logits, ref.continuation)
        out["ppl_exact"] = exact_ppl
        out["ppl_delta"] = metrics.perplexity(held, ref.continuation) / exact_ppl - 1.0
    return out


WINDOW_MEANS = ("attn_err", "attn_kl", "agree", "kl")  # averaged over a prompt's windows


def score_prompt(model, ids: torch.Tensor, codecs: list, window: int, continuation, tick: Tick | None = None, *,
                 windows_per_prompt: int = 1, ppl_tokens: int | None = None,
                 tie_margin: float = windows.TIE_MARGIN) -> dict:
    """Scores of every codec on one prompt ``ids`` ``[T]`` over ``windows_per_prompt`` windows: window ``i`` starts
    after the prompt and the first ``i·window`` tokens of ``continuation`` (the text's next tokens ``[N]``, or
    None; windows it is too short for are left out). Its first ``ppl_tokens`` tokens (None: all) score the
    perplexity change. Returns ``{codec name: {metric: value}}``, the draft metrics averaged over the windows, the
    prefixes listed per window (:func:`lynxkv.eval.windows.collect`); ``tick`` is called per codec and window."""
    from lynxkv.hf.models import check_context

    if windows_per_prompt < 1:
        raise InputError(f"--windows: expected >= 1, got {windows_per_prompt}")
    text = continuation if continuation is not None else torch.zeros(0, dtype=torch.long)
    count = min(windows_per_prompt, 1 + text.numel() // window)
    held = text if ppl_tokens is None else text[:ppl_tokens]
    check_context(model.config, int(ids.numel()), max(count * window, held.numel()))
    first: dict[str, dict] = {}
    rows: dict[str, list[dict]] = {c.name: [] for c in codecs}
    chosen: dict[str, int] = {}
    exact_kv, cached = None, 0  # the exact cache of the previous window's context, and its length
    for i in range(count):
        context = torch.cat([ids, text[: i * window]])
        if exact_kv is not None:  # the previous window's exact cache, extended by the text between the two
            exact_kv = extend_kv(model, exact_kv, context[cached:-1])
        ref = build_reference(model, context, window, held if i == 0 and held.numel() else None, exact_kv)
        exact_kv, cached = ref.prefix_kv, context.numel() - 1
        if i == 0:  # a scheme chosen per cache is chosen once, on the prompt's own cache, and kept for its windows
            codecs = _bind(codecs, model, ids[:-1], ref.prefix_kv, chosen)
        exact_attn, full_codes = exact_attention(ref), windows.FullCodes(model, ref)
        for codec in codecs:
            approx = roundtrip_cache(codec, ref.prefix_kv)
            logits = forward_logits(model, approx, window_inputs(ref.last_token, ref.tokens))  # [W, V]
            row = draft_scores(model, ref, approx, exact_attn, logits)
            row.update(windows.window_prefixes(model, ref, codec, approx, logits, full_codes, tie_margin))
            if i == 0:
                first[codec.name] = {**kv_scores(codec, ref.prefix_kv, approx), **_choice_of(codec.name, chosen),
                                     **{k: v for k, v in row.items() if k.startswith("ppl_")}}
            rows[codec.name].append(row)
            if tick:
                tick()
    return {name: {**first[name], **{k: _mean([r[k] for r in rs]) for k in WINDOW_MEANS}, **windows.collect(rs)}
            for name, rs in rows.items()}


def _bind(codecs: list, model, ids: torch.Tensor, kv: KVPairs, chosen: dict[str, int]) -> list:
    """``codecs``, each codec chosen per cache replaced by the codec of the scheme chosen for ``kv`` (one choice for
    all of them; its candidate's index recorded in ``chosen``)."""
    choice = None
    bound = []
    for codec in codecs:
        if hasattr(codec, "bind"):
            if choice is None:
                from lynxkv.hf.choose import choose_scheme

                choice = choose_scheme(model, ids, kv)
            chosen[codec.name] = choice.candidates.index(choice.scheme)
            codec = codec.bind(choice)
        bound.append(codec)
    return bound


def _choice_of(name: str, chosen: dict[str, int]) -> dict:
    return {"choice": chosen[name]} if name in chosen else {}


def score_kv(kv: KVPairs, codecs: list, tick: Tick | None = None) -> dict:
    """KV-only scores of every codec on a cache given as tensors (no model: no draft metrics)."""
    scores = {}
    for codec in codecs:
        if hasattr(codec, "bind"):
            raise InputError(f"--schemes: {codec.name} is chosen per cache by a model; a KV dump has none")
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
    """Average per-prompt scores per codec; pool the prefixes of every window
    (:func:`lynxkv.eval.windows.summarize_prefixes`)."""
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
        if rows and "choice" in rows[0]:  # a scheme chosen per cache: the candidate each prompt chose
            s["choices"] = [r["choice"] for r in rows]
        s.update(windows.summarize_prefixes([r for r in rows if "prefixes" in r], window))
        result[codec.name] = s
    return result


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan
