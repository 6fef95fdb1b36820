"""A ``transformers`` cache layer that appends in place: what the runner decodes on.

``DynamicLayer.update`` appends a token by ``torch.cat`` of the whole layer into new storage, so every decode step
copies the entire cache (SmolLM2 at 3,000 tokens in fp32: 138 MB a step) and touches fresh pages. A
:class:`GrowingLayer` keeps its tokens at the front of a buffer with room to spare and writes new tokens after
them: a step copies only its own token. ``crop`` (the runner drops rejected drafts) shortens the view, and the
next update writes over the dropped tokens. Tensors it was given (a stored cache's KV, which the runner shares
rather than copies) are never written: the first update copies them into its own buffer, as the ``torch.cat``
would have, unless the layer was told to adopt them (``adopt=True``): a load that hands out its KV as the front
of buffers with room to spare (``open_progressive(room=N)``) lets the layer grow into that room in place, so its
first step copies nothing either. An adopting layer writes from its own length on, which for a runner that
drops the cached prompt's last token to feed it again is that token's row of the given tensors. The attention
reads the same values in the same layout within each head, so the logits are the ``DynamicLayer`` 's bit for bit
(tests/test_hf_growing.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A :class:`~transformers.cache_utils.DynamicLayer` that appends into a buffer with spare room."""

    def __init__(self, room: int = 256, adopt: bool = False):
        super().__init__()
        self.room = room
        self.adopt = adopt  # the tensors given may be grown into in place, when they have the room (once)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def _owns(self) -> bool:
        """Whether ``keys``/``values`` are the front of this layer's own buffers (else: tensors it was given)."""
        return (self._k is not None and self.keys is not None and self.keys.numel() > 0
                and self.keys.data_ptr() == self._k.data_ptr() and self.values.data_ptr() == self._v.data_ptr())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        owned = self._owns()
        if not owned and self.adopt and n:
            self.adopt = False
            k, v = _buffer_of(self.keys, n + m), _buffer_of(self.values, n + m)
            if k is not None and v is not None:
                self._k, self._v, owned = k, v, True
        if not owned or n + m > self._k.shape[-2]:
            capacity = n + m + max(self.room, (n + m) // 8)
            shape = (*key_states.shape[:-2], capacity, key_states.shape[-1])
            k = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
            v = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)
            if n:
                k[..., :n, :].copy_(self.keys)
                v[..., :n, :].copy_(self.values)
            self._k, self._v = k, v
        self._k[..., n : n + m, :].copy_(key_states)
        self._v[..., n : n + m, :].copy_(value_states)
        self.keys, self.values = self._k[..., : n + m, :], self._v[..., : n + m, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._k = self._v = None  # the new tensors are copies: the next update re-homes them

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._k = self._v = None


def _buffer_of(x: torch.Tensor, need: int) -> torch.Tensor | None:
    """The whole buffer ``x`` ( ``[1, H, n, D]`` ) is the front of, when that buffer holds at least ``need``
    tokens a head laid out as ``[1, H, capacity, D]`` (what ``open_progressive(room=N)`` hands out); else None."""
    if x.dim() != 4 or x.shape[0] != 1 or x.storage_offset() != 0:
        return None
    _, h, _, d = x.shape
    if x.stride(-1) != 1 or x.stride(-2) != d or d == 0 or x.stride(-3) % d:
        return None
    capacity = x.stride(-3) // d
    if capacity < need or x.untyped_storage().nbytes() < h * capacity * d * x.element_size():
        return None
    return x.as_strided((1, h, capacity, d), (h * capacity * d, capacity * d, d, 1))


def grow_in_place(cache, room: int = 256, *, adopt: bool = False):
    """Replace every plain ``DynamicLayer`` of ``cache`` by a :class:`GrowingLayer` holding the same tensors (no
    copy here); other layer kinds are left as they are. ``adopt``: the layers may grow into the room of the
    buffers their tensors are the front of (see the module docstring). Returns ``cache``."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = _growing(layer, room, adopt)
    return cache


def _growing(layer, room: int, adopt: bool = False) -> GrowingLayer:
    """A :class:`GrowingLayer` holding ``layer`` 's tensors and state (views: nothing is copied here)."""
    grown = GrowingLayer(room, adopt)
    grown.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in ("room", "adopt", "_k", "_v")})
    return grown


def fork_cache(cache):
    """A second cache holding ``cache`` 's tokens, to grow apart from it (the runner's branch of its drafts).

    Nothing is copied here: the fork's layers hold views of ``cache`` 's tensors, and the fork's first update copies
    them into its own buffer (as a :class:`GrowingLayer` does with any tensors it was given), so its tokens never
    land in ``cache`` 's buffer. ``cache`` may go on appending meanwhile (it writes after the viewed tokens), but
    must not be cropped before the fork's first update. Returns None when a layer is of a kind this does not know
    (not a plain ``DynamicLayer`` or a :class:`GrowingLayer`).
    """
    import copy

    layers = []
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, GrowingLayer):
            return None
        layers.append(_growing(layer, getattr(layer, "room", 256)))
    forked = copy.copy(cache)
    forked.layers = layers
    return forked
