"""Abandon the draft step under way when the full code is in, so the verify does not wait for it.

The residual lands at a moment that has nothing to do with the draft steps, so on average half a draft step is
still to run when it does (a whole step on a CPU at long context, 50 ms for SmolLM2 at 3,000 tokens), and the
token that step drafts comes too late to be verified with the others. :class:`DraftInterrupt` puts a pre-forward
hook on every decoder layer and on the output head; while a draft forward runs, each hook checks whether the
residual has arrived (a future that is done without an error, or, for a progressive load, its last byte in) and,
if it has, ends the forward with
:class:`Superseded`. The runner then leaves its draft loop at once: the draft cache, which that forward may have
grown in some layers and not in others, is not used again (the full code replaces it, and a failed residual never
interrupts, so the anchor-only fallback always gets a whole cache).

The hooks go on at a request's first draft step and come off when its drafting ends (or the request leaves), not
at every step; between draft forwards they are disarmed and only compare a thread id. A model whose decoder layers
cannot be found gets no hooks: its draft steps run to their end, as before.
"""

from __future__ import annotations

import concurrent.futures
import threading
from contextlib import contextmanager

import torch


class Superseded(Exception):
    """The residual arrived while a draft forward ran: the forward was abandoned part-way."""


def decoder_modules(model) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` (the first ``ModuleList`` whose modules all have ``self_attn``), or []."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and all(hasattr(m, "self_attn") for m in module):
            return list(module)
    return []


def landed(future: concurrent.futures.Future) -> bool:
    """Whether ``future`` is done with a result (not cancelled, not failed); never waits."""
    return future.done() and not future.cancelled() and future.exception(timeout=0) is None


class DraftInterrupt:
    """Hooks that end a draft forward once ``residual`` has landed (see the module docstring)."""

    def __init__(self, model, residual: concurrent.futures.Future, also=None):
        self.residual = residual
        self.also = also  # another reason to end the forward (a callable: every residual byte is in)
        self.modules = decoder_modules(model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if self.modules and isinstance(head, torch.nn.Module):
            self.modules.append(head)
        self._armed_in: int | None = None  # the thread whose draft forward the hooks may end
        self._handles: list | None = None  # the registered hooks while installed
        self.abandoned = 0  # forwards ended part-way

    def _check(self, *_args) -> None:
        # another thread's forward on the same model (a server running several requests) is never ended
        if self._armed_in == threading.get_ident() and (
                landed(self.residual) or (self.also is not None and self.also())):
            self._armed_in = None
            self.abandoned += 1
            raise Superseded

    def install(self) -> None:
        """Put the hooks on the model (disarmed); a second call while they are on does nothing."""
        if self._handles is None:
            self._handles = [m.register_forward_pre_hook(self._check) for m in self.modules]

    def remove(self) -> None:
        """Take the hooks off the model; nothing to do when they are off."""
        self._armed_in = None
        handles, self._handles = self._handles, None
        for h in handles or ():
            h.remove()

    @contextmanager
    def installed(self):
        """The hooks on the model for the ``with`` block."""
        self.install()
        try:
            yield self
        finally:
            self.remove()

    def run(self, fn, *args):
        """``fn(*args)`` with the hooks armed: raises :class:`Superseded` when the residual lands during it."""
        self._armed_in = threading.get_ident()
        try:
            return fn(*args)
        finally:
            self._armed_in = None
