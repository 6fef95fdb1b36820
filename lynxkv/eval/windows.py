"""The accepted prefix of one draft window, measured so that codecs can be told apart.

One window says little: its prefix ends at the first disagreement, and one early near-tie of the exact logits
cuts it whatever the codec. So a prompt is scored on several windows (``lynxkv eval --windows N``): window ``i``
starts after the prompt and the first ``i·W`` tokens of the text that follows it, with the codec's round trip of
that whole context, and drafts against the exact cache's greedy tokens from there. The windows' contexts are the
text's own, not the model's greedy output, which a small model soon turns into a loop that any cache predicts
(SmolLM2, 4 held-out prompts, 8 windows of 64 along its own greedy continuation: after each prompt's first window,
28 of 28 accepted whole for the default anchor and 27 of 28 for KIVI-4).

Per window and codec:

- ``prefix``: the accepted prefix against the exact cache's greedy tokens (every codec);
- ``prefix_tie``: whether the disagreement that ended it fell on a near-tie, a position whose exact top-2 logit
  margin is below ``tie_margin`` (:func:`lynxkv.eval.metrics.top2_margin`); such windows are counted apart;
- for a lynx anchor, ``prefix_full`` and ``prefix_full_tie``: the same against greedy decoding on the scheme's
  own full code, the output Lynx guarantees and verifies drafts against (the near-tie judged on the full code's
  logits). Where the full code's teacher-forced argmaxes equal the exact tokens over the whole window its greedy
  tokens are those; otherwise they are decoded one token at a time on the full code.

:func:`summarize_prefixes` pools the windows of all prompts: means with their standard error over windows
(windows of one prompt share its text, so this error is a lower bound when they are correlated).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lynxkv.eval import metrics
from lynxkv.eval.baselines import roundtrip_cache
from lynxkv.eval.draft import Reference, forward_logits, greedy, window_inputs

#: Default near-tie threshold: an exact top-2 logit margin below this (in logits) makes a disagreement a near-tie.
TIE_MARGIN = 0.1


def prefix_and_tie(reference: torch.Tensor, reference_logits: torch.Tensor, predicted: torch.Tensor,
                   tie_margin: float) -> tuple[int, bool]:
    """(accepted prefix of ``predicted`` against ``reference``, both ``[W]``; whether the disagreement that ended
    it is a near-tie of ``reference_logits`` ``[W, V]``). A window accepted whole is no tie."""
    prefix = metrics.accepted_prefix(reference, predicted)
    if prefix == reference.numel():
        return prefix, False
    return prefix, bool(metrics.top2_margin(reference_logits[prefix]) < tie_margin)


class FullCodes:
    """The full code of each lynx scheme on one window: its round trip and its teacher-forced logits, computed once
    for the scheme's full-code codec and its anchor (:meth:`put` records a full code already scored)."""

    def __init__(self, model, ref: Reference):
        self.model, self.ref = model, ref
        self._done: dict = {}

    def put(self, codec, approx, logits: torch.Tensor) -> None:
        if _is_lynx(codec) and not codec.anchor_only:
            self._done[codec.scheme] = (approx, logits)

    def get(self, anchor_codec):
        if anchor_codec.scheme not in self._done:
            full = dataclasses.replace(anchor_codec, anchor_only=False)
            approx = roundtrip_cache(full, self.ref.prefix_kv)
            inputs = window_inputs(self.ref.last_token, self.ref.tokens)
            self._done[anchor_codec.scheme] = (approx, forward_logits(self.model, approx, inputs))
        return self._done[anchor_codec.scheme]


def _is_lynx(codec) -> bool:
    return hasattr(codec, "anchor_only") and hasattr(codec, "scheme")


def window_prefixes(model, ref: Reference, codec, approx, logits: torch.Tensor, full_codes: FullCodes,
                    tie_margin: float) -> dict:
    """The prefix scores of ``codec`` on one window (see the module docstring); ``logits`` ``[W, V]``: its
    teacher-forced logits on the exact tokens, ``approx`` its round trip of the window's context."""
    prefix, tie = prefix_and_tie(ref.tokens, ref.exact_logits, logits.argmax(-1), tie_margin)
    out = {"prefix": prefix, "prefix_tie": tie}
    full_codes.put(codec, approx, logits)
    if not (_is_lynx(codec) and codec.anchor_only):
        return out
    full_approx, full_logits = full_codes.get(codec)
    if torch.equal(full_logits.argmax(-1), ref.tokens):  # greedy on the full code gives the exact tokens
        tokens, reference_logits, predicted = ref.tokens, full_logits, logits.argmax(-1)
    else:
        tokens = greedy(model, full_approx, ref.last_token, ref.tokens.numel())
        inputs = window_inputs(ref.last_token, tokens)
        reference_logits = forward_logits(model, full_approx, inputs)
        predicted = forward_logits(model, approx, inputs).argmax(-1)
    out["prefix_full"], out["prefix_full_tie"] = prefix_and_tie(tokens, reference_logits, predicted, tie_margin)
    return out


def collect(rows: list[dict]) -> dict:
    """One prompt's window scores as lists, in window order: ``prefixes``, ``prefix_ties`` and, for an anchor,
    ``prefixes_full``, ``prefix_full_ties``; ``prefix``: their mean over the windows."""
    out = {"prefixes": [r["prefix"] for r in rows], "prefix_ties": [r["prefix_tie"] for r in rows]}
    out["prefix"] = sum(out["prefixes"]) / len(rows)
    if rows and "prefix_full" in rows[0]:
        out["prefixes_full"] = [r["prefix_full"] for r in rows]
        out["prefix_full_ties"] = [r["prefix_full_tie"] for r in rows]
    return out


def summarize_prefixes(rows: list[dict], window: int) -> dict:
    """Pool the windows of the prompts ``rows`` (each :func:`collect`'s dict): for the prefix against the exact
    cache ``prefix_mean``, ``prefix_std``, ``prefix_sem`` (over windows), ``prefixes``, ``prefix_curve``,
    ``exact_match`` and ``exact_match_16``, ``windows``, ``prefix_ties`` (windows that ended on a near-tie) and
    ``prefix_untied_mean`` / ``_sem`` over the others (None where there are none); for anchors the same against
    the full code (``prefix_full_mean`` ... ``prefix_full_untied_sem``)."""
    out: dict = {}
    prefixes = [p for r in rows for p in r["prefixes"]]
    if not prefixes:
        return out
    out.update(_pooled("prefix", prefixes, [t for r in rows for t in r["prefix_ties"]]))
    out["prefixes"] = prefixes
    out["prefix_curve"] = metrics.survival_curve(prefixes, window)
    out["exact_match"] = metrics.exact_match_rate(prefixes, window)
    out["exact_match_16"] = metrics.exact_match_rate(prefixes, min(16, window))
    if all("prefixes_full" in r for r in rows):
        full = [p for r in rows for p in r["prefixes_full"]]
        out.update(_pooled("prefix_full", full, [t for r in rows for t in r["prefix_full_ties"]]))
        out["prefixes_full"] = full
    return out


def _pooled(key: str, prefixes: list[int], ties: list[bool]) -> dict:
    mean, std = metrics.mean_std([float(p) for p in prefixes])
    untied = [float(p) for p, t in zip(prefixes, ties) if not t]
    untied_mean, untied_std = metrics.mean_std(untied) if untied else (None, None)  # None: every window tied
    return {
        f"{key}_mean": mean, f"{key}_std": std, f"{key}_sem": std / math.sqrt(len(prefixes)),
        f"{key}_ties": sum(ties), "windows": len(prefixes),
        f"{key}_untied_mean": untied_mean,
        f"{key}_untied_sem": untied_std / math.sqrt(len(untied)) if untied else None,
    }  # fmt: skip
