"""The verify pass: the drafts judged on the full code, in one forward or in passes, the longest valid prefix kept.

Shared by the single runner (:mod:`lynxkv.speculative.runner`) and the branch of its drafts
(:mod:`lynxkv.speculative.branch`); the batch runner verifies in its own packed forwards.
"""

from __future__ import annotations

import torch

from lynxkv.speculative.model_ops import forward_tokens
from lynxkv.speculative.sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs


def pass_sizes(k: int, chunk: int, first: int) -> list[int]:
    """How many of ``k`` drafts each verify pass takes, at most (the passes stop at the first rejection).

    ``chunk > 0``: ``chunk``, ``2·chunk``, ``4·chunk``, ... (``RunConfig.verify_chunk``). Otherwise ``first > 0``
    and more than twice as many drafts: ``first``, then the rest (``RunConfig.verify_first``). Otherwise one pass.
    """
    if k <= 0:
        return [0]
    if chunk > 0:
        sizes, n, total = [], chunk, 0
        while total < k:
            sizes.append(min(n, k - total))
            total += sizes[-1]
            n *= 2
        return sizes
    if 0 < first and 2 * first < k:
        return [first, k - first]
    return [k]


def cut_at(sizes: list[int], at: int) -> list[int]:
    """``sizes`` (:func:`pass_sizes`) with a pass ending right after the first ``at`` drafts, when ``at`` falls
    inside one: the branch's fork (:mod:`lynxkv.speculative.branch`), so that a main chain the full code rejects
    exactly there is not verified past it (the passes stop at the first rejection) before the branch is."""
    out, total = [], 0
    for size in sizes:
        if total < at < total + size:
            out += [at - total, total + size - at]
        else:
            out.append(size)
        total += size
    return out


def verify_drafts(model, cache, feed: list[int], drafts: list[int], draft_probs: list[torch.Tensor],
                  params: SamplingParams, generator, sizes: list[int]):
    """Verify ``drafts`` on the full cache (holding what ``feed`` follows) in passes of ``sizes`` drafts
    (:func:`pass_sizes`). A generator: after every pass that accepted all its drafts and is not the last, it
    yields how many drafts are accepted so far (final: the caller may commit them); it returns (accepted, next
    token, drafts fed into the cache, the drafts each forward pass fed).

    The first pass is ONE forward over ``feed`` + its drafts (``feed``: the last prompt token, or the new prompt
    tokens; :func:`~lynxkv.speculative.model_ops.first_step`); its last m+1 rows judge the drafts (row j judges
    draft j, row m the next one or gives the bonus); each later pass feeds only drafts. A multi-token forward is
    nearly free on a GPU but costs about ``k/8`` decode steps on a CPU at long context, so on a CPU with a poor
    anchor most of a long window is verified for nothing (``verify_chunk``), and a short first pass puts the first
    tokens out about one decode step after the residual (``verify_first``); in fp32 the rows, and so the
    accepted tokens, are the same either way. With sampling, a bonus drawn at the end of a fully accepted pass
    that is not the last one is discarded: an independent draw, so the law is unchanged.
    """
    k = len(drafts)
    pos, carry, passes = 0, None, []
    for size in sizes:
        m = min(size, k - pos)
        inputs = (feed if pos == 0 else []) + drafts[pos : pos + m]
        new_rows = forward_tokens(model, cache, inputs)  # [len(inputs), V]
        if pos == 0:
            new_rows = new_rows[len(feed) - 1 :]  # [m+1, V]: the row of the last fed token, then the drafts'
        passes.append(m)
        rows = new_rows if carry is None else torch.cat([carry, new_rows])  # [m+1, V]
        window = drafts[pos : pos + m]
        if params.greedy:
            n, next_token = accept_greedy(window, rows)
        else:
            target_probs = logits_to_probs(rows, params)  # [m+1, V]
            q = torch.stack(draft_probs[pos : pos + m]) if m else target_probs[:0]  # [m, V]
            n, next_token = accept_sampled(window, q, target_probs, generator)
        if n < m or pos + m == k:
            return pos + n, next_token, pos + m, passes
        carry, pos = rows[-1:], pos + m
        yield pos
    raise AssertionError(f"verify pass sizes {sizes} do not cover {k} drafts")


def run_to_end(gen):
    """Run a generator to its end and return its value (a verify whose passes commit nothing early)."""
    while True:
        try:
            next(gen)
        except StopIteration as end:
            return end.value
