"""A second greedy draft chain, forked where the anchor hesitates: what an early near-tie costs, bounded.

    main chain   d0 d1 .. dp .. d(k-1)       the anchor's greedy tokens (stats.draft_token_ids)
    fork at p    the first draft whose top-1 − top-2 logit margin on the anchor is below BRANCH_MARGIN (0.2):
                 the branch starts from the draft cache as it was before dp was fed, its root r the anchor's
                 runner-up there
    branch       r b0 b1 ..                  greedy on the anchor; every later draft step runs the main chain and
                                             the branch in ONE forward: with plain attention the branch keeps only
                                             its own tokens and reads the draft cache's first tokens in place, in
                                             one product with the main chain's query (packed.forward_forked); else
                                             it is a fork of the draft cache (lynxkv.hf.growing.fork_cache, which
                                             copies it at the first step) run by packed.forward_packed
    verify       the main chain in one forward. If it rejected exactly dp and the full code's token there is r (r
                 is then committed as the verify's own correction), one more forward over [r, b0, b1, ..] on the
                 same full cache judges the branch's drafts; the accepted ones and the next token are committed

On SmolLM2 every early disagreement of the anchor with the full code measured on the choosing corpus was a near
tie of the anchor's logits with the full code's token its runner-up (docs/results.md), so one branch at the first low-margin position rescues most of a window that one token
would otherwise end. Greedy only: with sampling the draft is a sample of the anchor's distribution, and a
runner-up branch has no place in the acceptance rule (min(1, p/q) over one chain). The reference for bf16 and
fp16, whose output depends on the forward shapes, is ``decode_plain(..., branch=(stats.branch_at,
stats.branch_token_ids))``; the branch's own draft forwards need no particular shape (the verify decides), so
their dense layers are batched in every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lynxkv.hf.growing import fork_cache
from lynxkv.speculative.model_ops import forward_tokens
from lynxkv.speculative.packed import forward_forked, forward_packed


@dataclass
class Branch:
    at: int  # the main chain's draft it replaces (index into the drafts)
    margin: float  # the anchor's top-1 − top-2 logit margin there
    cache: object  # the branch's tokens: after the draft cache's first ``prefix`` (shared), or a whole fork of it
    tokens: list[int]  # [root, b0, b1, ...]: the anchor's runner-up at ``at``, then the branch's greedy drafts
    ended: bool = False  # it drafted a stop token: it grows no more
    prefix: int | None = None  # the draft cache's length at the fork, when ``cache`` holds the branch's tokens only


class Brancher:
    """The draft loop's branch: where to fork (:meth:`consider`) and the branch's share of each draft forward
    (:meth:`forward`). One fork, at the first position below the bound: moving it to a later position of lower
    margin gained nothing on the choosing corpus at the chosen bound (docs/speculative.md, "Branching at
    low-margin positions"; benchmarks/diag_branch.py, policy "lowest")."""

    def __init__(self, margin: float, stops, *, shared: bool = False):
        self.margin, self.stops = margin, set(stops)
        self.shared = shared  # the model runs forward_forked: the branch shares the draft cache's prefix
        self.branch: Branch | None = None
        self.forks = 0  # forks made (0 or 1)
        self.packed_last = False  # the last forward ran two sequences

    def consider(self, logits: torch.Tensor, cache, at: int) -> None:
        """After a main draft forward (``logits`` [V] its last row, ``cache`` the draft cache before its token is
        fed, ``at`` the index that token takes among the drafts): fork here if the margin is below the bound."""
        top = logits.topk(2)
        margin = float(top.values[0] - top.values[1])
        if margin >= self.margin or self.branch is not None:
            return
        forked = fork_cache(cache)
        if forked is None:  # a cache layer this cannot fork: no branch
            return
        root, prefix = int(top.indices[1]), None
        if self.shared:  # the branch's own tokens only; the prefix is read from the draft cache
            forked, prefix = DynamicCache(), int(cache.get_seq_length())
        self.branch = Branch(at, margin, forked, [root], ended=root in self.stops, prefix=prefix)
        self.forks += 1

    def forward(self, model, cache, tokens: list[int]) -> torch.Tensor:
        """The main chain's forward of ``tokens`` after ``cache`` (its logits ``[len(tokens), V]``), and the
        branch's next greedy token in the same forward while the branch grows."""
        b = self.branch
        self.packed_last = b is not None and not b.ended
        if not self.packed_last:
            return forward_tokens(model, cache, tokens)
        if b.prefix is None:
            main, side = forward_packed(model, [cache, b.cache], [tokens, b.tokens[-1:]], batch_dense=True)
            side = side[-1]
        elif len(tokens) == 1:  # after the fork every draft step feeds one token per chain
            main, side = forward_forked(model, cache, b.cache, b.prefix, tokens[0], b.tokens[-1])
            main = main.unsqueeze(0)
        else:
            raise RuntimeError(f"a draft step after the fork fed {len(tokens)} tokens")
        token = int(side.argmax())
        b.tokens.append(token)
        b.ended = token in self.stops
        return main

    def record(self, stats) -> None:
        """Note the branch, if one was forked, in ``stats`` (a :class:`~lynxkv.speculative.stats.RunStats`)."""
        b = self.branch
        if b is not None:
            stats.branch_at, stats.branch_forks = b.at, self.forks
            stats.branch_token_ids = list(b.tokens)
            stats.branch_shared_prefix = b.prefix is not None

    def pending(self) -> Branch | None:
        """The branch, when it has drafts a verify could judge (its root and at least one more token)."""
        b = self.branch
        return b if b is not None and len(b.tokens) >= 2 else None

    def to_verify(self, accepted: int, next_token: int) -> Branch | None:
        """The branch, if the main chain's verify (``accepted`` drafts, then ``next_token``) rejected exactly
        the fork's draft in favour of the branch's root, and the branch has drafts to verify; else None."""
        b = self.pending()
        if b is None or accepted != b.at or next_token != b.tokens[0]:
            return None
        return b
