"""Speculative decoding over a progressively loading cache: draft on the anchor, verify on the full KV.

The loop is a chain of small functions (:mod:`.model_ops` for the model, :mod:`.sampling` for token choice and
the acceptance rules, :mod:`.runner` for the schedule); statistics come back as a :class:`RunStats`.
"""

from lynxkv.spec_decode.runner import (
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
from lynxkv.spec_decode.sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs
from lynxkv.spec_decode.stats import RunStats

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
