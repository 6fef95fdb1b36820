"""One forward for many requests: their new tokens packed into one sequence, attention per request on its own cache.

    requests b = 0 .. B-1, each with its own cache (L_b tokens) and n_b new tokens this step
    input_ids    [1, N]        N = sum n_b, request after request
    position_ids [1, N]        L_b .. L_b + n_b - 1 for request b: its own positions, as at batch 1
    dense layers (embedding, projections, MLP, norms, lm_head) run over all N rows at once (fp32), or request by
                               request (bf16, fp16; see "Why" below)
    attention    for each b:   q_b [1, heads, n_b, D] against request b's own cache, unpadded, with the mask its
                               batch-1 forward builds (the model's own mask functions, on that request's cache)
    logits       [N, V]        split back into [n_b, V] per request

Why this shape. A padded batch (one [B, H, L_max, D] cache with an attention mask) changes each request's
attention reductions: the padded keys change the kernel's blocking, so rows are not the batch-1 rows. Here every
request's attention is exactly its batch-1 call. The dense layers are where a batch pays on a CPU (the weights are
read once per step instead of once per request), but a matrix product's rounding depends on its number of rows
(measured with torch 2.13 on this project's CPUs: fp32 and fp16 round one row differently from two or more, bf16
from 18 rows on). In fp32 that is the same kind of difference as between the runner's multi-token verify and
single decode steps, which the project already measures to leave every argmax alone; in bf16 and fp16 such
differences flip near-ties, so there the dense layers run per request, with each request's batch-1 row count,
and the batch shares the steps and the schedule but not the weight reads (docs/speculative.md, "Batches").

The attention runs through a function registered with ``transformers``' ``AttentionInterface`` and selected only
for the duration of a packed forward; the mask functions see an implementation they do not know and build nothing
(the masks are built per request beforehand). The per-request caches are the runner's usual ones
(:func:`lynxkv.speculative.model_ops.start_cache`), so a request can leave the batch or go on alone at any step.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from lynxkv.hf.attention import IMPL as GROUPED_SDPA_IMPL, use_grouped_sdpa
from lynxkv.hf.prefill import forward

IMPL = "lynxkv_packed"
FORKED_IMPL = "lynxkv_forked"
_state = threading.local()


class _PackedCache:
    """Stands in for a ``transformers`` cache during a packed forward: ``update`` appends each request's slice of
    the new keys and values to that request's own cache and keeps the full per-request tensors for the attention."""

    def __init__(self, caches: list, sizes: list[int]):
        self.caches, self.sizes = caches, sizes
        self.layer_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # [1, H, N, D] each
        out, start = [], 0
        for cache, n in zip(self.caches, self.sizes):
            k = key_states[:, :, start : start + n]
            v = value_states[:, :, start : start + n]
            out.append(cache.update(k, v, layer_idx, *args, **kwargs))
            start += n
        self.layer_kv[layer_idx] = out
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # not used: positions are passed explicitly
        raise NotImplementedError("a packed forward passes explicit position ids")


def _packed_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention request by request: query ``[1, heads, N, D]``; returns ``[1, N, heads, D]``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    pack = _state.pack
    base = ALL_ATTENTION_FUNCTIONS.get(pack.base_impl)
    if base is None:  # "eager": the model's own function, in its modeling module
        base = sys.modules[type(module).__module__].eager_attention_forward
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    masks = pack.sliding_masks if window is not None else pack.full_masks
    outs, start = [], 0
    for (k, v), n, mask in zip(pack.cache.layer_kv[module.layer_idx], pack.cache.sizes, masks):
        o, _ = base(module, query[:, :, start : start + n], k, v, mask, **kwargs)
        outs.append(o)
        start += n
    return torch.cat(outs, dim=1), None


def _forked_attention(module, query, key, value, attention_mask, scaling: float | None = None, **kwargs):
    """A main chain and its fork, one new token each (query ``[1, heads, 2, D]``), the fork's cache holding only
    its tokens after the first ``pack.prefix`` of the main cache: every query row against that shared prefix in
    ONE product per key and value head, then each row against its own chain's tokens after it, one softmax over
    both parts. Returns ``[1, 2, heads, D]``. The prefix is read once for both chains, and the fork copies none of
    it (:func:`forward_forked`)."""
    pack = _state.pack
    (k_main, v_main), (k_fork, v_fork) = pack.cache.layer_kv[module.layer_idx]  # [1, Hkv, L, D] each
    p = pack.prefix
    hkv, d = k_main.shape[1], query.shape[-1]
    g = query.shape[1] // hkv
    scale = scaling if scaling is not None else d ** -0.5
    q = query[0].reshape(hkv, g * 2, d)  # query head h reads key head h // g; row (j, chain) of group h // g
    shared = torch.matmul(q, k_main[0, :, :p].transpose(1, 2)).mul_(scale).view(hkv, g, 2, p)
    probs_shared, outs = [], []
    for chain, (k, v) in enumerate(((k_main[0, :, p:], v_main[0, :, p:]), (k_fork[0], v_fork[0]))):
        own = torch.matmul(q.view(hkv, g, 2, d)[:, :, chain], k.transpose(1, 2)).mul_(scale)  # [Hkv, g, n]
        probs = torch.softmax(torch.cat((shared[:, :, chain], own), dim=-1), dim=-1, dtype=torch.float32)
        probs = probs.to(query.dtype)
        probs_shared.append(probs[..., :p])
        outs.append(torch.matmul(probs[..., p:], v))  # [Hkv, g, D]
    prefix_out = torch.matmul(torch.stack(probs_shared, dim=2).reshape(hkv, g * 2, p), v_main[0, :, :p])
    out = prefix_out.view(hkv, g, 2, d) + torch.stack(outs, dim=2)  # [Hkv, g, 2, D]
    return out.reshape(hkv * g, 2, d).transpose(0, 1).unsqueeze(0), None  # [1, 2, heads, D]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL, _packed_attention)
    AttentionInterface.register(FORKED_IMPL, _forked_attention)


class _Pack:
    def __init__(self, cache: _PackedCache, base_impl: str, full_masks: list, sliding_masks: list,
                 prefix: int = 0):
        self.cache, self.base_impl = cache, base_impl
        self.full_masks, self.sliding_masks = full_masks, sliding_masks
        self.prefix = prefix


def _request_masks(model, cache, n: int, positions: torch.Tensor) -> tuple:
    """The (full, sliding-window) masks a batch-1 forward of ``n`` tokens after ``cache`` builds."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = model.config
    embeds = torch.empty((1, n, 1), dtype=model.dtype, device=model.device)  # only its shape, dtype and device count
    args = dict(config=config, inputs_embeds=embeds, attention_mask=None, position_ids=positions)
    full = create_causal_mask(cache=cache, **args)
    sliding = None
    if getattr(config, "sliding_window", None) is not None:
        sliding = create_sliding_window_causal_mask(cache=cache, **args)
    return full, sliding


@contextlib.contextmanager
def _rowwise_linears(model, sizes: list[int]):
    """Within the block, every ``nn.Linear`` of ``model`` computes request by request (``sizes`` rows each of its
    packed input), so each request's rows are rounded as at batch 1."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def rowwise(mod):
        def fwd(x):  # [1, N, in]
            parts = torch.split(x, sizes, dim=1)
            return torch.cat([torch.nn.functional.linear(p, mod.weight, mod.bias) for p in parts], dim=1)
        return fwd

    for m in linears:
        m.forward = rowwise(m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def dense_batched(model) -> bool:
    """Whether the dense layers run over all requests' rows at once (fp32) or request by request (bf16, fp16)."""
    return model.dtype == torch.float32


@torch.no_grad()
def forward_packed(model, caches: list, token_lists: list[list[int]], *,
                   batch_dense: bool | None = None) -> list[torch.Tensor]:
    """Run ``token_lists[b]`` after ``caches[b]`` for every request b in one forward; each cache grows in place.
    Returns each request's logits ``[n_b, V]`` in fp32 (row j predicts the token after ``token_lists[b][j]``),
    the rows :func:`lynxkv.speculative.model_ops.forward_tokens` gives at batch 1 (see the module docstring).

    ``batch_dense=True`` runs the dense layers over all rows at once in every dtype, for forwards whose rows need
    not be the batch-1 rows (drafts, which a verify judges); None: :func:`dense_batched` decides."""
    sizes = [len(t) for t in token_lists]
    if any(n < 1 for n in sizes):
        raise ValueError("every request in a packed forward needs at least one token")
    if len(caches) == 1:  # nothing to pack: the batch-1 forward itself
        ids = torch.tensor(token_lists, dtype=torch.long, device=model.device)
        return [forward(model, ids, caches[0]).logits[0].float()]
    use_grouped_sdpa(model)  # the attention a batch-1 forward runs (lynxkv.hf.prefill.forward): the same rows
    positions, full_masks, sliding_masks = [], [], []
    for cache, n in zip(caches, sizes):
        past = int(cache.get_seq_length())
        pos = torch.arange(past, past + n, device=model.device).unsqueeze(0)  # [1, n_b]
        full, sliding = _request_masks(model, cache, n, pos)
        positions.append(pos)
        full_masks.append(full)
        sliding_masks.append(sliding)
    ids = torch.tensor([[t for toks in token_lists for t in toks]], dtype=torch.long, device=model.device)  # [1, N]
    packed = _PackedCache(caches, sizes)
    batched = dense_batched(model) if batch_dense is None else batch_dense
    rows = contextlib.nullcontext() if batched else _rowwise_linears(model, sizes)
    with _attention(model, IMPL, packed, full_masks, sliding_masks), rows:
        logits = forward_with_positions(model, ids, packed, torch.cat(positions, dim=1)).logits[0]  # [N, V]
    return [x.float() for x in torch.split(logits, sizes, dim=0)]


@contextlib.contextmanager
def _attention(model, impl: str, packed: _PackedCache, full_masks=(), sliding_masks=(), prefix: int = 0):
    """Within the block, ``model`` 's attention is ``impl`` (:data:`IMPL` or :data:`FORKED_IMPL`) over ``packed``,
    this thread's pack; the model's own implementation is restored after it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl not in ALL_ATTENTION_FUNCTIONS:
        _register()
    config = model.config
    base_impl = config._attn_implementation
    _state.pack = _Pack(packed, base_impl, list(full_masks), list(sliding_masks), prefix)
    config._attn_implementation = impl
    try:
        yield
    finally:
        config._attn_implementation = base_impl
        _state.pack = None


def forward_with_positions(model, ids, cache, positions):
    """``model`` over ``ids`` with explicit ``position_ids`` and the packed cache."""
    from lynxkv.hf.prefill import _cache_argument

    return model(input_ids=ids, position_ids=positions, use_cache=True, **{_cache_argument(type(model)): cache})


def shares_prefix(model) -> bool:
    """Whether :func:`forward_forked` can run ``model``: plain scaled dot-product attention over every cached
    token (SDPA or eager; no sliding window, soft-capping or attention sinks), on any device."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager", IMPL, FORKED_IMPL, GROUPED_SDPA_IMPL):
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return False
    return not any(getattr(config, name, None) for name in ("attn_logit_softcapping", "final_logit_softcapping",
                                                              "attention_bias_sinks", "sinks"))


@torch.no_grad()
def forward_forked(model, cache, fork, prefix: int, token: int, fork_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward for a chain and its fork, one new token each: ``token`` after ``cache`` (L tokens) and
    ``fork_token`` after the first ``prefix`` tokens of ``cache`` followed by ``fork`` (a cache holding only the
    fork's own tokens); both caches grow in place. Returns the two logits rows ``[V]`` in fp32.

    The dense layers run over both rows at once and the attention reads the shared prefix once for both
    (:func:`_forked_attention`), so a two-chain step costs about one step plus one token's dense work, and the
    fork never copies the prefix. Its rows are not those of a batch-1 forward to the last bit (the attention sums
    in another order): for drafts, which a verify judges. :func:`shares_prefix` says which models it runs."""
    past, own = int(cache.get_seq_length()), int(fork.get_seq_length())
    positions = torch.tensor([[past, prefix + own]], device=model.device)
    ids = torch.tensor([[token, fork_token]], dtype=torch.long, device=model.device)
    packed = _PackedCache([cache, fork], [1, 1])
    with _attention(model, FORKED_IMPL, packed, prefix=prefix):
        logits = forward_with_positions(model, ids, packed, positions).logits[0]  # [2, V]
    return logits[0].float(), logits[1].float()
