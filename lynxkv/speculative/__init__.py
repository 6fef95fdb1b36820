"""Speculative decoding over a progressively loading cache: draft on the anchor, verify on the full KV.

    from lynxkv.hf.models import load_model
    from lynxkv.speculative import RunConfig, SamplingParams, run, stream
    from lynxkv.stream.progressive import open_progressive

    lm = load_model()                                           # the offline SmolLM2
    load = open_progressive("cache.lynx", bandwidth="200Mbps")  # any CacheLoad (lynxkv.loading)
    result = run(lm.model, load, RunConfig(max_new_tokens=64), fingerprint=lm.fingerprint)
    result.token_ids, result.stats.tt(64), result.stats.acceptance_rate

    for ev in stream(lm.model, load2, RunConfig(sampling=SamplingParams(0.8, 0.95), seed=1), provisional=True):
        ev.kind  # "draft" (provisional), "commit" (final; `confirmed` drafts first), "retract", "done" (stats)

Greedy output is token for token that of plain greedy decoding on the full cache (:func:`decode_plain`); sampled
output follows the same distribution (speculative sampling), reproducibly for a given ``seed``. The loop is a
chain of small functions (:mod:`.model_ops` for the model, :mod:`.sampling` for token choice and the acceptance
rules, :mod:`.runner` for the schedule, :mod:`.compare` for the monolithic baselines); statistics come back as a
:class:`RunStats`.
"""

from lynxkv.speculative.runner import (
    AcceptanceTracker,
    Event,
    ResidualUnavailable,
    RunConfig,
    RunResult,
    check_load,
    decode_plain,
    run,
    stream,
)
from lynxkv.speculative.sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs
from lynxkv.speculative.stats import RunStats

__all__ = [
    "AcceptanceTracker",
    "Event",
    "ResidualUnavailable",
    "RunConfig",
    "RunResult",
    "RunStats",
    "SamplingParams",
    "accept_greedy",
    "accept_sampled",
    "check_load",
    "decode_plain",
    "logits_to_probs",
    "run",
    "stream",
]
