"""What a request asks of the engine (:class:`RunConfig`), what it hands back (:class:`Event`, :class:`RunResult`),
and the small rules both sides share (what is committed, when a request is finished, which caches it accepts)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

from lynxkv.cache.loading import CacheLoad
from lynxkv.errors import InputError
from lynxkv.speculative.sampling import SamplingParams
from lynxkv.speculative.stats import RunStats

# Fixed behaviour, chosen on held-out prompts (docs/results.md); not options.
BRANCH_MARGIN = 0.2  # greedy: fork a second draft chain at the first draft whose anchor top-1 − top-2 margin is below
ETA_GUARD = 0.5  # a drafting request sits out a step when its residual is due within this fraction of a draft step


@dataclass(frozen=True)
class RunConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None  # sampling RNG seed (None: nondeterministic)
    stop_token_ids: tuple[int, ...] = ()
    max_window: int = 64  # cap on drafted tokens (0: no drafting)
    speculate: bool = True  # False: wait for the residual, then decode plainly (the monolithic full-code run)
    anchor_timeout: float | None = None  # seconds from the start
    residual_timeout: float | None = None  # seconds from the start
    allow_anchor_only: bool = False  # on residual failure, continue unverified on the anchor (flagged)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_window < 0:
            raise InputError(f"max_window must be >= 0, got {self.max_window}")
        for name in ("anchor_timeout", "residual_timeout"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise InputError(f"{name} must be >= 0 seconds, got {value}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        # torch.Generator.manual_seed takes what fits 64 bits, signed or not: more fails at the run's start
        if self.seed is not None:
            try:
                seed = None if isinstance(self.seed, bool) else operator.index(self.seed)  # numpy ints too
            except TypeError:
                seed = None
            if seed is None or not -2**63 <= seed < 2**64:
                raise InputError(f"seed must be an integer that fits 64 bits (-2**63 to 2**64 - 1), got {self.seed!r}")
            object.__setattr__(self, "seed", seed)


@dataclass
class Event:
    """One step of a run, for a UI or a serving engine.

    ``draft``: provisional ``tokens`` (only with ``provisional=True``); ``commit``: final ``tokens`` (the first
    ``confirmed`` of them were the oldest provisional ones); ``retract``: the newest ``count`` provisional tokens
    are withdrawn; ``done``: the end, with ``stats``. ``verified`` is False only for anchor-only output.
    """

    kind: str
    time_s: float
    tokens: list[int] = field(default_factory=list)
    confirmed: int = 0
    count: int = 0
    verified: bool = True
    stats: RunStats | None = None


@dataclass
class RunResult:
    token_ids: list[int]
    stats: RunStats

    @property
    def verified(self) -> bool:
        return self.stats.verified


@dataclass
class BatchRequest:
    """One request of a batch: its load (or a function that opens it at the arrival time), its config, and new
    prompt tokens after the cached prompt."""

    load: CacheLoad | Callable[[], CacheLoad]
    config: RunConfig = RunConfig()
    new_token_ids: list[int] | None = None
    arrival_s: float = 0.0  # seconds after the batch started
    name: str = ""


@dataclass
class RequestResult:
    name: str
    token_ids: list[int]
    stats: RunStats
    error: str | None = None  # why the request ended without its output (the others were not affected)
    arrival_s: float = 0.0

    @property
    def verified(self) -> bool:
        return self.error is None and self.stats.verified


def clip_tokens(tokens: list[int], room: int, stops) -> list[int]:
    """What of ``tokens`` is committed: at most ``room`` of them, up to and including the first stop token."""
    tokens = tokens[: max(0, room)]
    for i, tok in enumerate(tokens):
        if tok in stops:
            return tokens[: i + 1]
    return tokens


def is_finished(committed: list[int], max_new_tokens: int, stops) -> bool:
    """Whether a request that committed ``committed`` is done: ``max_new_tokens`` reached, or a stop token last."""
    return len(committed) >= max_new_tokens or (bool(committed) and committed[-1] in stops)


def check_load(load: CacheLoad, fingerprint: str) -> list[int]:
    """The load's prompt token ids, after refusing caches made by another model or without token ids."""
    ids = load.prompt_token_ids
    if not ids:
        raise InputError("the cache records no prompt token ids, so there is no prompt to continue")
    if load.model_fingerprint is None:
        raise InputError("the cache does not record which model made it (no model fingerprint)")
    if load.model_fingerprint != fingerprint:
        raise InputError(
            f"the cache was made by another model (fingerprint {load.model_fingerprint}, "
            f"this model is {fingerprint}); pass the model that produced it"
        )
    return [int(t) for t in ids]
