"""When drafting pays: the runner's two reasons to wait for the residual instead of drafting on the anchor.

1. **The window is too short** (:func:`wait_reason`). Drafting costs the verify pass's extra rows (on a CPU about
   a fifth of a decode step per draft) and, when the residual lands during a draft step, the rest of that step;
   it saves one decode step per accepted draft. With the residual due within ``min_window_steps`` decode steps
   of the anchor (a fast link, a short prompt), there is no room for drafts that would pay for that, so the run
   waits and starts on the full code at once: it is then the monolithic full-code run, and never slower than it
   by more than the noise. The step time comes from ``RunConfig.step_estimate_s`` or from this model's last
   measured step in this process (:func:`remember_step`, scaled to the cache length), which :func:`calibrate`
   provides before a process's first run; with neither, the run drafts (and the ETA guard still stops a draft
   that would overrun the residual).
2. **The anchor keeps disagreeing** (:class:`AcceptanceTracker`): recent windows accepted too little.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

# The default of RunConfig.min_window_steps and `lynxkv run --min-window` (docs/speculative.md, "When drafting pays")
MIN_WINDOW_STEPS = 4.0

_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (cache tokens, seconds per step)
_LOCK = threading.Lock()


def remember_step(model, tokens: int, seconds: float) -> None:
    """Note that one plain decode step of ``model`` after ``tokens`` cached tokens took ``seconds``."""
    with _LOCK:
        try:
            _STEPS[model] = (max(1, int(tokens)), float(seconds))
        except TypeError:  # not weak-referenceable: nothing is remembered
            pass


# Up to this many cached tokens calibrate() times a step at the cache's own length; beyond it at half the length
# or more (step_estimate scales a step by the length up to twice it). Its zeros and the cache they are copied into
# hold at most two copies of the prompt's KV, for a moment before the load opens; a run holds three at its verify
CALIBRATE_WHOLE_TOKENS = 8192


def calibrate(model, tokens: int, steps: int = 3) -> float | None:
    """Measure ``model``'s plain decode step after ``tokens`` cached tokens and remember it (:func:`remember_step`);
    returns the seconds, or None for an empty cache.

    The cache is zeros of the model's KV shape (a step costs the same whatever the values), ``tokens`` long up to
    :data:`CALIBRATE_WHOLE_TOKENS`, half as long or more beyond, so that a run's first window is judged on this
    machine's real step before the first draft: without it a process's first run always drafts. One warm-up step,
    then the median of ``steps``; the warm-up also takes the model's first-call initialisation out of the run.
    ``lynxkv run`` calls it after loading the model, before opening the cache's load (about a quarter of a second
    for SmolLM2 at 3,000 tokens on two cores)."""
    import torch

    from lynxkv.hf.models import kv_shape
    from lynxkv.speculative.model_ops import measure_tpot

    tokens = int(tokens)
    length = min(tokens, max(CALIBRATE_WHOLE_TOKENS, -(-tokens // 2)))
    if length < 1:
        return None
    layers, heads, head_dim = kv_shape(model.config)

    def zeros():
        return torch.zeros(heads, length, head_dim, dtype=model.dtype, device=model.device)

    kv = [(zeros(), zeros()) for _ in range(layers)]
    seconds = measure_tpot(model, kv, length + 1, steps=steps)  # a cache of `length` tokens, then one more
    remember_step(model, length, seconds)
    return seconds


def step_estimate(model, tokens: int) -> float | None:
    """This model's decode step at ``tokens`` cached tokens, from its last remembered step (scaled by the cache
    length, only within a factor of two of it), or None."""
    with _LOCK:
        try:
            seen = _STEPS.get(model)
        except TypeError:
            seen = None
    if seen is None:
        return None
    at, seconds = seen
    ratio = max(1, tokens) / at
    return seconds * ratio if 0.5 <= ratio <= 2.0 else None


def wait_reason(model, eta: float | None, tokens: int, min_window_steps: float,
                estimate: float | None = None) -> str | None:
    """Why this run should wait for the residual instead of drafting (None: draft). ``eta``: the residual's
    expected seconds to go at anchor-ready (None: unknown, draft); ``tokens``: the prompt's length."""
    step = estimate if estimate is not None else step_estimate(model, tokens)
    if eta is None or step is None or step <= 0 or eta >= min_window_steps * step:
        return None
    return (f"the residual was due in {eta:.3f} s, under {min_window_steps:g} decode steps "
            f"({step * 1e3:.0f} ms each): waiting for it instead of drafting")


@dataclass
class AcceptanceTracker:
    """Acceptance of recent verify windows, shared across runs on the same kind of cache.

    When the last ``patience`` windows all accepted less than ``threshold`` of their drafts, drafting is not
    worth its compute (the paper's advice: wait for the residual instead). Every ``retry_every``-th skipped run
    drafts again, so a recovery is noticed.
    """

    threshold: float = 0.2
    patience: int = 3
    retry_every: int = 8
    rates: list[float] = field(default_factory=list)
    skipped: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.rates.append(accepted / drafted)
            del self.rates[: -max(self.patience, 1)]

    def skip_reason(self) -> str | None:
        """Why the next run should not draft, or None to draft (counts the skip)."""
        recent = self.rates[-self.patience :]
        if len(recent) < self.patience or max(recent) >= self.threshold:
            return None
        self.skipped += 1
        if self.skipped % self.retry_every == 0:
            return None
        return (
            f"acceptance below {self.threshold:.2f} in the last {self.patience} windows "
            f"({', '.join(f'{r:.2f}' for r in recent)}): waiting for the residual instead of drafting"
        )


