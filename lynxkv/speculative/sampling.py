"""Token choice and the speculative acceptance rules, as pure functions over logits and probabilities.

Greedy (temperature 0): a draft token is accepted when it equals the target's argmax, and the first mismatch is
replaced by the target's argmax. The committed sequence is then exactly greedy decoding on the target cache.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d`` was drawn from the draft distribution
``q``; with the target distribution ``p`` at the same position it is accepted with probability
``min(1, p[d] / q[d])``. At the first rejection the replacement is drawn from ``norm(max(0, p - q))``; when all
``k`` drafts are accepted, a bonus token is drawn from the target's ``(k+1)``-th distribution. Every committed
token is then distributed exactly as if sampled from ``p`` directly:
``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) * max(0, p(x)-q(x)) / sum_y max(0, p(y)-q(y))
= min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x)``.
``p`` and ``q`` here are the distributions after temperature and top-p, the same processing for both, so
the output follows top-p sampling on the full cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynxkv.errors import InputError


# The smallest temperature that samples (vLLM's ``_SAMPLING_EPS``): below it the distribution is greedy in all
# but name, and ``logits / temperature`` can overflow fp32 to inf (softmax then gives NaN, and drawing from it fails).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise softmax(logits / temperature) restricted to the top-p mass.
    A sampling temperature is finite and at least :data:`MIN_TEMPERATURE`."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not (t >= 0.0) or t != t:  # NaN fails both
            raise InputError(f"temperature must be >= 0, got {t}")
        if t == float("inf"):
            raise InputError(f"temperature must be finite, got {t}")
        if 0.0 < t < MIN_TEMPERATURE:
            raise InputError(f"temperature {t} is too small to sample from (the smallest is {MIN_TEMPERATURE:g}); "
                             "use 0 for greedy decoding")
        if not (0.0 < self.top_p <= 1.0):  # NaN and infinities fail it too
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution(s) ``[..., V]`` (fp32) from logits ``[..., V]`` with temperature and top-p.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the token that crosses the
    threshold is kept), then renormalises.
    """
    if params.greedy:
        raise InputError("logits_to_probs needs temperature > 0 (greedy decoding takes the argmax)")
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # [..., V]
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
        sorted_p = torch.where(mass_before < params.top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from ``probs`` ``[V]``."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """The next token from logits ``[V]``: (token, its sampling distribution ``[V]`` or None when greedy)."""
    if params.greedy:
        return int(torch.argmax(logits).item()), None
    probs = logits_to_probs(logits, params)
    return sample(probs, generator), probs


def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: (number of drafts accepted, the next token).

    ``target_logits`` ``[k+1, V]``: row j is the target's prediction for the token at draft position j (row k
    predicts the bonus token after all k drafts).
    """
    k = len(draft_tokens)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} drafts, got {target_logits.shape[0]}")
    target_tokens = target_logits.argmax(dim=-1).tolist()  # [k+1]
    n = 0
    while n < k and draft_tokens[n] == target_tokens[n]:
        n += 1
    return n, int(target_tokens[n])


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` ``[V]``: what to sample after a rejection.

    If ``p <= q`` everywhere (only possible when ``p == q`` up to rounding, where a rejection has probability
    ~0) the target itself is returned.
    """
    diff = (target_probs - draft_probs).clamp_min(0.0)
    total = diff.sum()
    if not bool(total > 0):
        return target_probs
    return diff / total


def accept_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling verification: (number of drafts accepted, the next token).

    ``draft_probs`` ``[k, V]``: the distribution each draft was drawn from; ``target_probs`` ``[k+1, V]``.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(f"need {k} draft rows and {k + 1} target rows, got {draft_probs.shape[0]} and {target_probs.shape[0]}")
    for j, token in enumerate(draft_tokens):
        p, q = float(target_probs[j, token]), float(draft_probs[j, token])
        u = float(torch.rand((), generator=generator, device=None if generator is None else generator.device))
        # accept with probability min(1, p/q); q > 0 because the draft was drawn from it
        if u * q < p:
            continue
        return j, sample(residual_distribution(target_probs[j], draft_probs[j]), generator)
    return k, sample(target_probs[k], generator)
