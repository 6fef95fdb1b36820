"""What a run measured, returned as data (the CLI prints it; nothing here prints).

All times are seconds since the run started (the moment :func:`lynxkv.speculative.stream` was entered, which
callers place right after opening the load, so it is also the load's start up to microseconds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunStats:
    prompt_tokens: int = 0  # cached + new prompt tokens
    cached_prompt_tokens: int = 0
    anchor_ready_s: float | None = None  # wait_anchor() returned
    residual_ready_s: float | None = None  # the residual future completed (observed by a callback)
    residual_seen_s: float | None = None  # the runner took the full KV (after any in-flight draft step)
    verify_start_s: float | None = None  # the full cache was rebuilt and the verify forward began
    verify_end_s: float | None = None  # the verify forward(s) ended (the accepted tokens are committed next)
    first_draft_s: float | None = None
    first_commit_s: float | None = None
    commit_times_s: list[float] = field(default_factory=list)  # one per committed token, in order
    # The timeline (lynxkv.bench.timeline): [start, end] of every draft forward on the anchor cache, and
    # [start, end, cache tokens before it] of every plain decode step (after the verify, or of a baseline).
    draft_steps: list[list[float]] = field(default_factory=list)
    decode_steps: list[list[float]] = field(default_factory=list)
    drafted: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # fed to the verify pass after the prompt
    # The branch of the drafts (greedy; lynxkv.speculative.branch): the main chain's draft it
    # forked at (None: no fork), its tokens [root, drafts ...] (fed to its verify pass, if that ran), the forks
    # made, how many of its drafts the verify accepted (None: not verified: the main chain was not rejected at the
    # fork in favour of the root), that verify's seconds, and [start, end] of the draft forwards that ran both chains
    # (also in draft_steps). decode_plain(..., branch=(branch_at, branch_token_ids)) reproduces the forward shapes.
    branch_at: int | None = None
    branch_token_ids: list[int] = field(default_factory=list)
    branch_forks: int = 0
    branch_accepted: int | None = None
    branch_verify_s: float | None = None
    branch_draft_steps: list[list[float]] = field(default_factory=list)
    # the branch read the draft cache's tokens before the fork in place (a run alone, on a model with plain attention)
    branch_shared_prefix: bool = False
    accepted: int = 0
    window_cap: int = 0
    window_planned: int | None = None  # from the residual ETA and the draft step time, at the first draft
    # Mean time of one draft forward on the anchor cache, the first one left out (unless it is the only one): like
    # the verify pass before the plain steps, the first forward on a fresh cache grows it into new storage (the
    # whole KV, first touched), which no later step pays. That one is first_draft_step_s (None when several new
    # prompt tokens were prefilled first: the prefill grew the cache). With a branch its two-chain steps count too.
    draft_step_s: float | None = None
    first_draft_step_s: float | None = None
    verify_s: float | None = None  # the verify forward(s) over [last, d0 .. d(k-1)]
    verify_passes: int = 0  # 1 once the verify ran (0: never reached)
    # The layered verify (lynxkv.speculative.layered): the verify forward started while the residual was still
    # arriving, each layer as its residual landed; verify_waited_s of verify_s went to waiting for layers, and
    # residual_seen_s is when the last layer was in. In a batch, a layered verify whose layer came later than the
    # residual's estimate allowed was given up (verify_layered_abandoned) and the verify ran after the residual.
    verify_layered: bool = False
    verify_layered_abandoned: bool = False
    verify_waited_s: float | None = None
    decode_step_s: float | None = None  # mean time of one plain decode step after the verify (full cache)
    waited_on_eta: bool = False  # stopped drafting because the residual was due within a fraction of a step
    layers_dequantized_between_drafts: int = 0  # residual layers the runner dequantized itself while drafting
    drafts_abandoned: int = 0  # draft forwards ended part-way because the full code came in (1 or 0)
    drafting_disabled: str | None = None  # why no drafts were made although speculation was on
    verified: bool = True  # False only for explicitly requested anchor-only output
    residual_error: str | None = None
    load: dict = field(default_factory=dict)  # the transport's own LoadTimeline

    @property
    def committed(self) -> int:
        return len(self.commit_times_s)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def residual_after_anchor_s(self) -> float | None:
        """t_res: how long the residual kept the decoder waiting after the anchor was usable."""
        if self.residual_ready_s is None or self.anchor_ready_s is None:
            return None
        return max(0.0, self.residual_ready_s - self.anchor_ready_s)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token of plain decoding (after the verify; the draft step time if none ran)."""
        return self.decode_step_s if self.decode_step_s is not None else self.draft_step_s

    def tt(self, n: int) -> float | None:
        """Time to ``n`` committed tokens (None if fewer were committed)."""
        return self.commit_times_s[n - 1] if 0 < n <= len(self.commit_times_s) else None

    def gain_theoretical(self, n: int) -> float | None:
        """Δ = min(t_res, n·TPOT): the most drafting during the residual transfer can save on TT-n."""
        t_res, tpot = self.residual_after_anchor_s, self.tpot_s
        if t_res is None or tpot is None:
            return None
        return min(t_res, n * tpot)

    def gain_estimated(self, n: int) -> float | None:
        """Measured TT-n against the counterfactual "wait for the residual, then decode n tokens at the
        measured TPOT" (``--compare`` measures that baseline instead of estimating it)."""
        tt, tpot = self.tt(n), self.tpot_s
        if tt is None or tpot is None or self.residual_ready_s is None:
            return None
        return self.residual_ready_s + n * tpot - tt

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            committed=self.committed,
            acceptance_rate=self.acceptance_rate,
            residual_after_anchor_s=self.residual_after_anchor_s,
            tpot_s=self.tpot_s,
            tt1_s=self.tt(1),
            tt32_s=self.tt(32),
            tt64_s=self.tt(64),
            gain_theoretical_64_s=self.gain_theoretical(64),
            gain_estimated_64_s=self.gain_estimated(64),
        )
        return d
