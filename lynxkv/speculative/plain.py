"""Plain decoding on a stored cache without speculation: the reference the runner's output equals."""

from __future__ import annotations

import torch

from lynxkv.errors import InputError
from lynxkv.cache.kv import KVPairs
from lynxkv.speculative.model_ops import drop_last, first_step, forward_tokens, start_cache
from lynxkv.speculative.sampling import SamplingParams, choose


@torch.no_grad()
def decode_plain(
    model,
    kv: KVPairs,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    *,
    new_token_ids: list[int] | None = None,
    first_forward: list[int] | None = None,
    branch: tuple[int | None, list[int]] | None = None,
    generator: torch.Generator | None = None,
    stop_token_ids: tuple[int, ...] = (),
) -> list[int]:
    """Plain decoding on ``kv`` without speculation: the reference the runner's output equals.

    The same start as the runner (:func:`~lynxkv.speculative.model_ops.first_step`): the cache holds the prompt
    minus its last token and the first forward feeds that token; or, with ``new_token_ids``, the cache holds the
    whole stored prompt and the first forward feeds the new tokens. Then one token per forward.

    ``first_forward`` (greedy only) fixes the shape of that first forward as the runner's verify pass has it: the
    tokens it appends after the fed prompt tokens (pass the run's ``stats.draft_token_ids``). Greedy decoding
    then takes the argmax of every row of that one forward up to the first row whose argmax differs from the
    appended token, drops the rest, and continues one token per forward. In fp32 this changes nothing (one
    multi-token forward and sequential steps give the same argmaxes); in bf16 and fp16 the two round
    differently and can flip a near-tie, so a bf16 run is compared with the reference of its own forward shapes.
    ``branch=(position, [root, drafts ...])`` (greedy, with ``first_forward``) reproduces the runner's branch of
    its drafts (``(stats.branch_at, stats.branch_token_ids)``): when the first forward's argmaxes stop matching
    exactly at ``position`` with ``root`` as the next token, and the branch has drafts, the next forward feeds
    ``[root, drafts ...]`` at once and its argmaxes are taken up to the first that differs from the next draft.
    """
    keep, feed = first_step([int(t) for t in prompt_ids], new_token_ids)
    appended = [int(t) for t in (first_forward or ())]
    if appended and not sampling.greedy:
        raise InputError("first_forward defines greedy decoding only")
    cache = start_cache(model, kv, keep)
    out: list[int] = []
    if appended:
        # best[j]: the argmax after the fed prompt tokens and appended[:j]
        best = forward_tokens(model, cache, feed + appended)[len(feed) - 1 :].argmax(dim=-1).tolist()
        fed = len(appended)
        n = 0
        while n < fed and best[n] == appended[n]:
            n += 1
        out = best[: n + 1]
        drop_last(cache, fed - n)
        at, side = branch if branch is not None else (None, [])
        if (at == n and len(side) > 1 and out[-1] == side[0] and len(out) < max_new_tokens
                and out[-1] not in stop_token_ids):
            best = forward_tokens(model, cache, side).argmax(dim=-1).tolist()  # best[j]: after side[: j + 1]
            m = 0
            while m < len(side) - 1 and best[m] == side[m + 1]:
                m += 1
            out += best[: m + 1]
            drop_last(cache, len(side) - 1 - m)
    else:
        rows = forward_tokens(model, cache, feed)[len(feed) - 1 :]
        out = [choose(rows[-1], sampling, generator)[0]]
    for i, tok in enumerate(out):
        if tok in stop_token_ids or i + 1 == max_new_tokens:
            return out[: i + 1]
    while len(out) < max_new_tokens:
        logits = forward_tokens(model, cache, [out[-1]])[-1]
        out.append(choose(logits, sampling, generator)[0])
        if out[-1] in stop_token_ids:
            break
    return out
