"""The few model-facing steps of the runner: start a cache from stored KV, run tokens, drop rejected tokens.

Where the first new token comes from (:func:`first_step`): a stored cache holds KV for all T prompt tokens but
not the logits of the last one. To continue the cached prompt itself, the cache keeps the first T-1 tokens of
the stored KV and the runner re-feeds the last prompt token, so the first prediction is a normal forward on
exactly the cache being evaluated (anchor-only for drafting, full for verifying); the recomputed KV of that
token is the model's own value, not the quantized one: one token out of T. With new text after the cached
prompt (a question about a cached document) the cache keeps all T stored tokens and the first forward feeds the
new tokens: plain decoding on the full stored cache with that text. The reference decoder
(:func:`lynxkv.speculative.decode_plain`) starts the same way, so "identical to decoding on the full cache"
compares like with like.

Dtypes: the stored dtype (what the file records) and the compute dtype (the model's) are independent. The
cache is converted to the model's dtype and device here, once, when a run starts.
"""

from __future__ import annotations

import torch

from lynxkv.errors import InputError
from lynxkv.hf.convert import kv_to_cache
from lynxkv.hf.growing import grow_in_place
from lynxkv.hf.prefill import forward
from lynxkv.hf.models import kv_shape
from lynxkv.cache.kv import KVPairs


def check_kv(kv: KVPairs, config, prompt_len: int, what: str) -> None:
    """The KV matches the model's (layers, kv_heads, head_dim) and holds every prompt token in every layer."""
    layers, heads, head_dim = kv_shape(config)
    if len(kv) != layers:
        raise InputError(f"{what} KV has {len(kv)} layers, the model has {layers}")
    for i, (k, _) in enumerate(kv):
        if k.dim() != 3 or k.shape[0] != heads or k.shape[2] != head_dim:
            raise InputError(f"{what} KV layer {i} shape {tuple(k.shape)} does not match the model's "
                             f"[{heads}, T, {head_dim}]")
        if k.shape[1] != prompt_len:
            raise InputError(f"{what} KV layer {i} holds {k.shape[1]} tokens but the prompt has {prompt_len} "
                             f"token ids")


def first_step(prompt: list[int], new: list[int] | None) -> tuple[int, list[int]]:
    """(how many stored tokens the cache keeps, the tokens the first forward feeds) for continuing ``prompt``
    (the cached prompt's ids) with the ``new`` prompt tokens, if any."""
    if new:
        return len(prompt), [int(t) for t in new]
    return len(prompt) - 1, [int(prompt[-1])]


def start_cache(model, kv: KVPairs, keep: int, *, adopt: bool = False):
    """A fresh ``transformers`` cache, in ``model`` 's dtype and on its device, with the first ``keep`` tokens of
    ``kv`` (each ``[H, T, D]``).

    Built over all T tokens and then cropped: when the stored dtype is the model's, both steps are views, so
    opening a 4K-token cache costs nothing (slicing ``[:, :keep]`` first would copy every layer). The tensors may
    be shared with ``kv`` but are never written: the layers are :class:`~lynxkv.hf.growing.GrowingLayer` s, whose
    first update copies them into a buffer with room to spare, where later tokens are appended in place.
    ``adopt``: unless they are the front of buffers with room (a load's ``grow_in_place``): then the first update
    writes into that room and row ``keep`` on, and nothing is copied (:mod:`lynxkv.hf.growing`).
    """
    from transformers import DynamicCache

    if keep <= 0:
        return DynamicCache()
    cache = kv_to_cache(kv, dtype=model.dtype, device=model.device)
    drop_last(cache, int(cache.get_seq_length()) - keep)
    return grow_in_place(cache, adopt=adopt)


@torch.no_grad()
def forward_tokens(model, cache, tokens: list[int]) -> torch.Tensor:
    """Run ``tokens`` after the cache (which grows in place); logits ``[len(tokens), V]`` in fp32.

    Row j predicts the token that follows ``tokens[j]``.
    """
    ids = torch.tensor([tokens], dtype=torch.long, device=model.device)  # [1, n]
    out = forward(model, ids, cache)
    return out.logits[0].float()  # [n, V]


def settle(model) -> None:
    """Wait until the work queued on ``model``'s stream is done (a CUDA stream runs behind the host, so a step is
    timed once its kernels have run; the wait costs nothing, as its logits are read right after). Only the
    model's own stream: a load decoding on a stream of its own goes on. Nothing to wait for on the CPU."""
    if model.device.type == "cuda":
        torch.cuda.current_stream(model.device).synchronize()


def drop_last(cache, count: int) -> None:
    """Remove the last ``count`` tokens from ``cache`` in place.

    ``DynamicCache.crop`` in transformers 5.x takes a negative count of tokens to remove (a positive argument
    raises); ``crop(0)`` is a no-op, so 0 is handled the same way here.
    """
    if count < 0:
        raise ValueError(f"cannot drop {count} tokens")
    if count:
        cache.crop(-count)


def trim_to(cache, length: int) -> None:
    """Cut every layer of ``cache`` that holds more than ``length`` tokens back to ``length`` (a forward ended
    part-way leaves some layers one step longer than the others)."""
    for layer in cache.layers:
        extra = int(layer.get_seq_length()) - length
        if extra > 0:
            layer.crop(-extra)


def measure_tpot(model, kv: KVPairs, prompt_len: int, steps: int = 4) -> float:
    """Median seconds of one plain decode step after a cache of ``prompt_len`` tokens (one warm-up step)."""
    import time

    cache = start_cache(model, kv, prompt_len - 1)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        forward_tokens(model, cache, [0])
        settle(model)
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]
