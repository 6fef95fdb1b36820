"""The layered verify: the verify forward runs while the residual is still arriving, each decoder layer as soon as
its own residual is in.

The residual is stored and sent layer-major, and layer ``i`` of the verify forward needs only the full code of
layer ``i`` (and the hidden states of layer ``i-1``, computed on the full code below it). So the forward over
``[fed tokens, d0 .. d(k-1)]`` can start before the residual is complete: a pre-forward hook on every decoder
layer waits for that layer's residual (:meth:`lynxkv.stream.ProgressiveLoad.layer_in`), dequantizes it
(:meth:`~lynxkv.stream.ProgressiveLoad.full_layer`) and puts it in the verify cache in place of the anchor's,
before the layer reads it. Every layer computes exactly what the verify on the whole full cache computes (the
same tensors, the same forward shape), so the rows, and the accepted tokens, are identical; what changes is
when: layers whose residual landed while the runner drafted are verified at once, the others as they land, and
after the last byte only the last layer (and the logits) remain. The runner stops drafting when the residual is
due within the verify's own length (:meth:`lynxkv.speculative.timing.Timing.verify_estimate`), so that the forward catches up with the arriving
layers by the time the last one lands.

The cache starts as the anchor's (the same shapes, so the attention masks built before the first layer are the
right ones) and every layer is replaced before its first use; a layer kind other than ``DynamicLayer`` (or its
in-place :class:`~lynxkv.hf.growing.GrowingLayer`), or
a model whose decoder layers cannot be found, makes :func:`decoder_layers` return None and the runner verifies
after the whole residual as before.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from lynxkv.errors import InputError
from lynxkv.speculative.interrupt import decoder_modules

def decoder_layers(model, cache) -> list[tuple[int, torch.nn.Module]] | None:
    """``(cache layer index, decoder layer module)`` for every layer of ``model``, or None when the model's layers
    or the cache's layer kinds are not the ones the layered verify knows."""
    from transformers.cache_utils import DynamicLayer

    layers = decoder_modules(model)
    if not layers or len(layers) != len(cache.layers) \
            or any(not isinstance(layer, DynamicLayer) or layer.is_sliding for layer in cache.layers):
        return None
    out = []
    for i, m in enumerate(layers):
        index = getattr(m.self_attn, "layer_idx", i)
        if not isinstance(index, int) or not 0 <= index < len(cache.layers):
            return None
        out.append((index, m))
    if sorted(i for i, _ in out) != list(range(len(cache.layers))):
        return None
    return out


class LayeredVerify:
    """Hooks that fill the verify cache layer by layer from a load as the forward reaches each layer.

    By default a layer that does not arrive by ``deadline`` raises :class:`TimeoutError` in the forward, and the
    load's failure its own error. With ``soft=True`` (a forward that computes other requests' rows too, in a
    batch) nothing is raised: the pass records why in :attr:`failure` and fills no further layer, so the forward
    ends with this pass's rows wrong, for the caller to drop. ``patience`` (a ``time.perf_counter()``, soft only)
    bounds the waits as well: a layer not in by then leaves :attr:`failure` set with :attr:`late` True (the
    residual may still come; the caller verifies after it instead)."""

    def __init__(self, load, cache, layers: list[tuple[int, torch.nn.Module]], keep: int, dtype, device,
                 deadline: float | None = None, *, soft: bool = False, patience: float | None = None,
                 adopt: bool = False):
        self.load, self.cache, self.layers, self.keep = load, cache, layers, keep
        self.adopt = adopt  # a filled layer may grow into the room of the load's full-code buffers
        self.dtype, self.device, self.deadline = dtype, device, deadline  # deadline: a time.perf_counter()
        self.soft, self.patience = soft, patience if soft else None
        self.waited_s = 0.0  # time the forward spent waiting for layers to arrive
        self.last_layer_s: float | None = None  # perf_counter when the last layer's residual was in
        self.failure: str | None = None  # soft: why a layer could not be filled
        self.late = False  # soft: the failure is the patience's, not the load's nor the deadline's
        self._filled: set[int] = set()

    def _fill(self, index: int) -> None:
        if index in self._filled or self.failure is not None:  # a later pass reads the grown layer
            return
        try:
            self._take(index)
        except Exception as exc:  # the load's failure, whatever its type (soft: noted, never raised in the forward)
            if not self.soft:
                raise
            self.failure = f"the residual failed: {exc}"

    def _take(self, index: int) -> None:
        t = time.perf_counter()
        limits = [x for x in (self.deadline, self.patience) if x is not None]
        timeout = max(0.0, min(limits) - t) if limits else None
        try:
            arrived = self.load.layer_in(index, timeout)
        finally:
            now = time.perf_counter()
            self.waited_s += now - t
        if not arrived:
            message = f"the residual of layer {index} did not arrive in time"
            if not self.soft:
                raise TimeoutError(message)
            self.failure, self.late = message, self.deadline is None or now < self.deadline
            return
        self.last_layer_s = now
        k, v = self.load.full_layer(index)
        layer = self.cache.layers[index]
        heads, _, dim = layer.keys.shape[1:]  # the anchor's [1, H, keep, D]
        for name, x in (("keys", k), ("values", v)):
            if x.dim() != 3 or x.shape[0] != heads or x.shape[2] != dim or x.shape[1] < self.keep:
                raise InputError(f"the full code's layer {index} {name} have shape {tuple(x.shape)}, not "
                                 f"[{heads}, >= {self.keep}, {dim}] as the anchor's")
        # what kv_to_cache and the crop to the kept tokens make of the whole full code (views when the dtype matches)
        layer.keys = k.to(dtype=self.dtype, device=self.device).unsqueeze(0)[..., : self.keep, :]
        layer.values = v.to(dtype=self.dtype, device=self.device).unsqueeze(0)[..., : self.keep, :]
        if self.adopt and hasattr(layer, "adopt"):
            layer.adopt = True
        self._filled.add(index)

    @contextmanager
    def installed(self):
        handles = [module.register_forward_pre_hook(lambda _m, _a, i=index: self._fill(i))
                   for index, module in self.layers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
