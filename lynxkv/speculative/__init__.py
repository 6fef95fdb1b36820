"""The speculative decode engine: draft on the anchor while the residual arrives, verify on the full code, continue."""

from lynxkv.errors import ResidualUnavailable
from lynxkv.speculative.config import BatchRequest, Event, RequestResult, RunConfig, RunResult, check_load
from lynxkv.speculative.engine import BatchResult, run, run_batch, stream
from lynxkv.speculative.plain import decode_plain
from lynxkv.speculative.sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs
from lynxkv.speculative.stats import RunStats
from lynxkv.speculative.timing import Timing

__all__ = [
    "BatchRequest",
    "BatchResult",
    "Event",
    "ResidualUnavailable",
    "RunConfig",
    "RunResult",
    "RequestResult",
    "RunStats",
    "SamplingParams",
    "Timing",
    "accept_greedy",
    "accept_sampled",
    "check_load",
    "decode_plain",
    "logits_to_probs",
    "run",
    "run_batch",
    "stream",
]
