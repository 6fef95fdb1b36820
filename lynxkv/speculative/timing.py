"""What the engine knows of this machine's speed: one explicit object, handed to the engine, that it reads and
updates.

Two decisions need a time before the engine can measure it in the run at hand:

1. **Draft or wait** (:meth:`Timing.wait_reason`). Drafting costs the verify pass's extra rows (on a CPU about a
   fifth of a decode step per draft) and, when the residual lands during a draft step, the rest of that step; it
   saves one decode step per accepted draft. With the residual due within :data:`MIN_WINDOW_STEPS` decode steps
   of the anchor (a fast link, a short prompt) there is no room for drafts that would pay for that, so the
   request waits and starts on the full code at once: it is then the monolithic full-code run. The step comes
   from :meth:`Timing.calibrate` (one warm-up step, then the median of a few, on a cache of zeros as long as the
   prompt) or from the last plain decode step this object saw (:meth:`Timing.note_step`); with neither, the
   request drafts, and the ETA guard still ends a draft that would overrun the residual.
2. **When to start the layered verify** (:meth:`Timing.verify_estimate`): a verify of ``rows`` rows keeps the
   model busy about ``(1 + row_cost · rows)`` decode steps; the cost per row is learned from the verifies this
   object saw (one figure for a request alone, one for a packed batch step).

The residual's ETA is not here: it is the load's, from the bytes it has seen arrive.
"""

from __future__ import annotations

import threading

import torch

# Wait for the residual instead of drafting when, at anchor-ready, it is due within this many decode steps.
MIN_WINDOW_STEPS = 4.0
# A verify forward over k rows costs about (1 + ROW_COST · k) decode steps on a CPU at long context (SmolLM2,
# 2-3K tokens: 3.8 steps for 22 drafts, 4 for 17), until a verify has been measured.
ROW_COST = 0.16
# calibrate() times a step at the cache's own length up to this many tokens, beyond it at half the length or more
# (step() scales a step by the length within a factor of two): its zeros and the cache they are copied into hold at
# most two copies of the prompt's KV, for a moment before the load opens.
CALIBRATE_WHOLE_TOKENS = 8192


class Timing:
    """Decode-step and verify-cost estimates for one model on this machine (thread-safe)."""

    def __init__(self, step_s: float | None = None, at_tokens: int = 1):
        self._lock = threading.Lock()
        self._step = None if step_s is None else (max(1, int(at_tokens)), float(step_s))
        self._row_cost = {False: ROW_COST, True: ROW_COST}  # batch? -> decode steps per verified row

    # ---- the decode step ------------------------------------------------------------------------------------
    def note_step(self, tokens: int, seconds: float) -> None:
        """One plain decode step after ``tokens`` cached tokens took ``seconds``."""
        with self._lock:
            self._step = (max(1, int(tokens)), float(seconds))

    def step(self, tokens: int) -> float | None:
        """A decode step's seconds at ``tokens`` cached tokens, scaled from the last one noted (only within a
        factor of two of its length), or None."""
        with self._lock:
            seen = self._step
        if seen is None:
            return None
        at, seconds = seen
        ratio = max(1, tokens) / at
        return seconds * ratio if 0.5 <= ratio <= 2.0 else None

    def calibrate(self, model, tokens: int, steps: int = 3) -> float | None:
        """Measure ``model``'s plain decode step after ``tokens`` cached tokens and note it; the seconds, or None
        for an empty cache. One warm-up step first: it also takes the model's first-call initialisation out of the
        run that follows."""
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
        self.note_step(length, seconds)
        return seconds

    def wait_reason(self, eta: float | None, tokens: int) -> str | None:
        """Why a request should wait for its residual instead of drafting (None: draft). ``eta``: the residual's
        expected seconds to go at anchor-ready (None: unknown, draft); ``tokens``: the prompt's length."""
        step = self.step(tokens)
        if eta is None or step is None or step <= 0 or eta >= MIN_WINDOW_STEPS * step:
            return None
        return (f"the residual was due in {eta:.3f} s, under {MIN_WINDOW_STEPS:g} decode steps "
                f"({step * 1e3:.0f} ms each): waiting for it instead of drafting")

    # ---- the verify -----------------------------------------------------------------------------------------
    def verify_estimate(self, rows: int, step: float, *, batch: bool = False) -> float:
        """Seconds a verify of ``rows`` rows keeps the model busy, given a decode step of ``step`` seconds
        (``batch``: a packed step of a batch)."""
        with self._lock:
            cost = self._row_cost[batch]
        return step * (1.0 + cost * rows)

    def note_verify(self, rows: int, busy: float, step: float, *, batch: bool = False) -> None:
        """A verify of ``rows`` rows kept the model busy ``busy`` seconds, with decode steps of ``step``."""
        if rows <= 0 or step <= 0:
            return
        cost = min(1.0, max(0.02, (busy / step - 1.0) / rows))  # a verified row costs more than a step: noise
        with self._lock:
            self._row_cost[batch] = cost
