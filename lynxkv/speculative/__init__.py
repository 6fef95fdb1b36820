"""The speculative runner: draft on the anchor while the residual arrives, verify on the full code, continue."""

from lynxkv.speculative.runner import (
    AcceptanceTracker,
    Event,
    ResidualUnavailable,
    RunConfig,
    RunResult,
    check_load,
    run,
    stream,
)
from lynxkv.speculative.batch import BatchRequest, BatchResult, RequestResult, run_batch
from lynxkv.speculative.plain import decode_plain
from lynxkv.speculative.sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs
from lynxkv.speculative.stats import RunStats

__all__ = [
    "AcceptanceTracker",
    "BatchRequest",
    "BatchResult",
    "Event",
    "ResidualUnavailable",
    "RunConfig",
    "RunResult",
    "RequestResult",
    "RunStats",
    "SamplingParams",
    "accept_greedy",
    "accept_sampled",
    "check_load",
    "decode_plain",
    "logits_to_probs",
    "run",
    "run_batch",
    "stream",
]
