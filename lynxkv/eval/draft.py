"""Model side of the evaluation: the exact reference of one prompt and teacher-forced windows on any cache.

The prompt's last token is held back: the cache under test holds the KV of ``prompt[:-1]``, and every window
is fed as ``[last, t0 … t(W−2)]``, so each of its W predictions depends on that cache (the shape of a Lynx
draft-and-verify window). The reference tokens are the greedy continuation on the exact cache, decoded one
token at a time; a single forward of the same W inputs on an approximate cache then gives, position by
position, what decoding on that cache would draft after the same history (teacher forcing).

Runs in fp32 (bf16 forwards flip argmaxes by themselves; DESIGN.md). A transformers cache grows in place
(:func:`lynxkv.hf.forward`), so every forward gets a freshly built cache.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lynxkv.errors import InputError
from lynxkv.hf import forward, kv_to_cache, prefill
from lynxkv.hf.growing import grow_in_place
from lynxkv.cache.kv import KVPairs, cache_to_kv


@dataclass
class Reference:
    """The exact-cache side of one prompt."""

    prefix_kv: KVPairs  # per layer (keys, values), each [H, T-1, D]
    last_token: int
    tokens: torch.Tensor  # [W] greedy continuation on the exact cache
    exact_logits: torch.Tensor  # [W, V] teacher-forced on the exact cache
    queries: list[torch.Tensor]  # per layer [Hq, W, D], after RoPE, of the window's tokens
    scaling: float  # the attention's softmax scale
    continuation: torch.Tensor | None  # [N] the text's own tokens after the prompt (for perplexity)
    continuation_exact_logits: torch.Tensor | None  # [N, V]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "head_dim")]
    if not mods:
        raise InputError(f"cannot find attention modules with q_proj in {type(model).__name__}")
    return mods


@contextmanager
def captured_queries(model: torch.nn.Module):
    """Record, for every attention layer, the queries it computes (after RoPE) as ``[Hq, W, D]``.

    A forward pre-hook recomputes ``q`` from the layer's own input with the layer's ``q_proj`` (and ``q_norm``
    where the architecture has one) and the rotary helper of the layer's modelling module, so the queries are
    exactly the ones the model's attention uses.
    """
    mods = _attention_modules(model)
    store: list[torch.Tensor | None] = [None] * len(mods)
    handles = []

    def make_hook(i: int, mod: torch.nn.Module):
        rope = getattr(sys.modules[type(mod).__module__], "apply_rotary_pos_emb", None)

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # [1, W, hidden]
            q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)  # [1, W, Hq, D]
            if getattr(module, "q_norm", None) is not None:
                q = module.q_norm(q)
            q = q.transpose(1, 2)  # [1, Hq, W, D]
            pos = kwargs.get("position_embeddings")
            if pos is None and len(args) > 1:
                pos = args[1]
            if pos is not None and rope is not None:
                cos, sin = pos
                q, _ = rope(q, q, cos, sin)
            store[i] = q[0].detach().clone()

        return hook

    for i, mod in enumerate(mods):
        handles.append(mod.register_forward_pre_hook(make_hook(i, mod), with_kwargs=True))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def forward_logits(model: torch.nn.Module, kv: KVPairs, inputs: torch.Tensor) -> torch.Tensor:
    """One forward of ``inputs`` ``[W]`` on a fresh cache built from ``kv``: logits ``[W, V]`` in fp32."""
    cache = kv_to_cache(kv, dtype=model.dtype)
    out = forward(model, inputs.reshape(1, -1), cache)
    return out.logits[0].float()


@torch.no_grad()
def greedy(model: torch.nn.Module, kv: KVPairs, first: int, steps: int) -> torch.Tensor:
    """Greedy decoding of ``steps`` tokens after feeding ``first`` on ``kv``, one token per forward: ``[steps]``.
    The cache grows in place (:mod:`lynxkv.hf.growing`: the same logits, without copying it at every step)."""
    cache = grow_in_place(kv_to_cache(kv, dtype=model.dtype), room=steps + 1)
    token = torch.tensor([[first]])
    out_tokens = []
    for _ in range(steps):
        out = forward(model, token, cache)
        nxt = int(out.logits[0, -1].argmax())
        out_tokens.append(nxt)
        token = torch.tensor([[nxt]])
    return torch.tensor(out_tokens, dtype=torch.long)


def window_inputs(last: int, tokens: torch.Tensor) -> torch.Tensor:
    """``[last, t0 … t(W−2)]``: the inputs whose W predictions are ``t0 … t(W−1)``."""
    return torch.cat([torch.tensor([last]), tokens[:-1]])


@torch.no_grad()
def extend_kv(model: torch.nn.Module, kv: KVPairs, ids: torch.Tensor) -> KVPairs:
    """The exact cache ``kv`` followed by the tokens ``ids`` ``[N]``: one forward of them on it (the same KV as a
    prefill of the whole text up to fp32 rounding)."""
    if ids.numel() == 0:
        return kv
    cache = kv_to_cache(kv, dtype=model.dtype)
    forward(model, ids.reshape(1, -1), cache, logits_to_keep=1)
    return cache_to_kv(cache)


@torch.no_grad()
def build_reference(
    model: torch.nn.Module,
    ids: torch.Tensor,
    window: int,
    continuation: torch.Tensor | None = None,
    kv: KVPairs | None = None,
) -> Reference:
    """Prefill ``ids`` ``[T]`` (or take ``kv``, the exact cache of ``ids[:-1]`` already computed), decode the greedy
    reference and record everything the scores compare against."""
    if ids.numel() < 2:
        raise InputError("the prompt must have at least 2 tokens")
    if window < 1:
        raise InputError(f"--window: expected >= 1, got {window}")
    if kv is None:
        kv, _ = prefill(model, ids[:-1])
    last = int(ids[-1])
    tokens = greedy(model, kv, last, window)
    with captured_queries(model) as store:
        exact_logits = forward_logits(model, kv, window_inputs(last, tokens))
    queries = [q for q in store if q is not None]
    scaling = float(getattr(_attention_modules(model)[0], "scaling", queries[0].shape[-1] ** -0.5))
    held_logits = None
    if continuation is not None and continuation.numel() >= 1:
        held_logits = forward_logits(model, kv, window_inputs(last, continuation))
    else:
        continuation = None
    return Reference(kv, last, tokens, exact_logits, queries, scaling, continuation, held_logits)
