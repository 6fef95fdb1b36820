"""Error metrics of an approximate KV cache: pure functions over tensors, no model inside.

Notation: ``x`` is an exact keys or values tensor ``[H, T, D]`` (H KV heads, T tokens, D head_dim), ``x̂`` its
reconstruction. A "vector" is one ``[D]`` row: one head's key or value of one token, the unit attention reads.

- per-vector vNMSE (DRIVE / EDEN): ``mean_v ‖x̂_v − x_v‖² / ‖x_v‖²`` over vectors with ``‖x_v‖ > 0``;
- global vNMSE: ``Σ_v ‖x̂_v − x_v‖² / Σ_v ‖x_v‖²`` (one ratio of sums, dominated by the large vectors).

The two differ by how much small vectors count: a quantizer with per-chunk scales makes the relative error of
small vectors larger, which only the per-vector mean sees. Tables say which one they show.
"""

from __future__ import annotations

import math

import torch

from lynxkv.errors import InputError


def vnmse_per_vector(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean over vectors of ``‖x̂−x‖²/‖x‖²`` (rows along the last axis; zero rows are skipped)."""
    x, x_hat = x.double(), x_hat.double()
    num = (x_hat - x).pow(2).sum(-1).reshape(-1)  # [H*T]
    den = x.pow(2).sum(-1).reshape(-1)
    keep = den > 0
    if not bool(keep.any()):
        return 0.0
    return float((num[keep] / den[keep]).mean())


def vnmse_global(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``Σ‖x̂−x‖² / Σ‖x‖²`` over the whole tensor (0 for an all-zero ``x`` reconstructed exactly)."""
    x, x_hat = x.double(), x_hat.double()
    num = float((x_hat - x).pow(2).sum())
    den = float(x.pow(2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """Unmasked softmax attention of queries ``[Hq, W, D]`` over keys/values ``[H_kv, T, D]`` (Hq a multiple
    of H_kv; query head h reads KV head h // (Hq/H_kv)). Returns (output ``[Hq, W, D]``, log-weights
    ``[Hq, W, T]``), in fp64."""
    hq, w, d = q.shape
    hk = k.shape[0]
    if hq % hk:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hk}")
    scale = scale if scale is not None else d**-0.5
    qg = q.double().reshape(hk, (hq // hk) * w, d)  # [H_kv, groups·W, D]: a group's queries share a KV head
    logits = torch.matmul(qg, k.double().transpose(-1, -2)) * scale  # [H_kv, groups·W, T]
    logw = torch.log_softmax(logits, dim=-1)
    out = torch.matmul(logw.exp(), v.double())  # [H_kv, groups·W, D]
    return out.reshape(hq, w, -1), logw.reshape(hq, w, -1)


def attention_error_vs(
    exact: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    scale: float | None = None,
) -> tuple[float, float]:
    """:func:`attention_error` with the exact ``(output, log-weights)`` of :func:`attention` computed once."""
    out, logp = exact
    out_hat, logp_hat = attention(q, k_hat, v_hat, scale)
    rel = float((out_hat - out).pow(2).sum() / out.pow(2).sum().clamp_min(1e-300))
    kl = (logp.exp() * (logp - logp_hat)).sum(-1).clamp_min(0.0)  # [Hq, W]
    return rel, float(kl.mean())


def attention_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    scale: float | None = None,
) -> tuple[float, float]:
    """Attention-output error of an approximate cache for real queries ``q`` ``[Hq, W, D]``.

    Returns (relative output error ``Σ‖ô−o‖² / Σ‖o‖²`` with ``o = softmax(qKᵀ·scale)V``,
    mean over (head, query) of ``KL(p ‖ p̂)`` of the attention weights, in nats).
    """
    return attention_error_vs(attention(q, k, v, scale), q, k_hat, v_hat, scale)


def next_token_kl(exact_logits: torch.Tensor, approx_logits: torch.Tensor) -> torch.Tensor:
    """Per position ``KL(softmax(exact) ‖ softmax(approx))`` in nats: logits ``[W, V]`` → ``[W]``."""
    lp = torch.log_softmax(exact_logits.double(), dim=-1)
    lq = torch.log_softmax(approx_logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def accepted_prefix(reference: torch.Tensor, predicted: torch.Tensor) -> int:
    """Length of the longest prefix on which ``predicted`` equals ``reference`` (both ``[W]`` token ids):
    what one speculative window drafted on the approximate cache would keep after verification."""
    miss = (reference != predicted).nonzero()
    return int(miss[0, 0]) if miss.numel() else int(reference.numel())


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Per position, the gap between the largest and the second largest logit: ``[W, V]`` → ``[W]``. A small gap
    is a near-tie, which any perturbation of the cache may flip."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def agreement(reference: torch.Tensor, predicted: torch.Tensor) -> float:
    """Top-1 agreement: the fraction of positions where ``predicted == reference``."""
    return float((reference == predicted).double().mean()) if reference.numel() else 1.0


def survival_curve(prefixes: list[int], window: int) -> list[float]:
    """``P(accepted ≥ k)`` for ``k = 0 … window`` over the given accepted-prefix lengths."""
    if not prefixes:
        return [1.0] + [0.0] * window
    t = torch.tensor(prefixes)
    return [float((t >= k).double().mean()) for k in range(window + 1)]


def exact_match_rate(prefixes: list[int], length: int) -> float:
    """Fraction of greedy continuations of ``length`` tokens that are identical on the approximate cache.

    A greedy continuation on the approximate cache agrees with the exact one exactly as long as the teacher-
    forced argmaxes do (position j sees the same earlier tokens in both), so it is ``P(accepted ≥ length)``.
    """
    return float(sum(p >= length for p in prefixes) / len(prefixes)) if prefixes else 1.0


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """``exp(mean NLL)`` of ``targets`` ``[W]`` under ``logits`` ``[W, V]``."""
    nll = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="mean")
    return float(torch.exp(nll))


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for fewer than two values)."""
    if not values:
        return math.nan, math.nan
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def kv_error(full, anchor, original) -> dict:
    """Global vNMSE per layer of keys and values, full and anchor-only KV against the original, and the means
    over layers (per-layer ``(keys, values)`` ``[H, T, D]`` each)."""
    _check_like(len(original), tuple(original[0][0].shape), len(full), tuple(full[0][0].shape))
    return _layer_errors(full, anchor, original)


def _check_like(original_layers: int, original_shape: tuple, layers: int, shape: tuple) -> None:
    if original_layers != layers or original_shape != shape:
        raise InputError(f"the original has {original_layers} layers of {original_shape}, the cache {layers} of "
                         f"{shape}")


def _layer_errors(full, anchor, original) -> dict:
    """:func:`kv_error` of three iterables of layers, taken one layer of each at a time."""
    rows = []
    for (kf, vf), (ka, va), (k, v) in zip(full, anchor, original):
        rows.append({"key_full": vnmse_global(k, kf), "value_full": vnmse_global(v, vf),
                     "key_anchor": vnmse_global(k, ka), "value_anchor": vnmse_global(v, va)})
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return {"metric": "global vNMSE per layer, mean over layers", "per_layer": rows, "mean": mean}


def reconstruction_error(cache_path, original_path, *, residual=None, allow_locations=()) -> dict:
    """:func:`kv_error` of a stored cache (full and anchor-only reconstruction) against the original dump, one
    layer of each at a time (memory holds three layers, not the caches)."""
    from lynxkv.cache import open_cache
    from lynxkv.cache.dumps import open_dump

    dump = open_dump(original_path)
    with open_cache(cache_path, residual=residual, allow_locations=allow_locations) as c:
        i = c.info
        _check_like(dump.layers, dump.shape, i.layers, (i.kv_heads, i.tokens, i.head_dim))
        return _layer_errors(c.iter_layers(dtype=torch.float32, window=1),
                             c.iter_layers(anchor_only=True, dtype=torch.float32, window=1), dump.iter_layers())
