"""Many requests at once: each drafts on its own anchor, is verified when its own residual lands, then decodes on
its full code, and every step runs all of them in ONE packed forward (lynxkv.speculative.packed).

    arrive  ->  open its load (at its arrival time); it joins the next step once its anchor is in
    draft   ->  its last token on its anchor cache, in the step's forward, until its residual is in or its window
                is full (then it waits while the others go on)
    verify  ->  [fed prompt tokens, d0 .. d(k-1)] on its full cache, in the step's forward; accept as the single
                runner does (greedy: argmax match; sampling: min(1, p/q)), commit, drop the rejected tokens;
                layer by layer as its residual lands when that is due within the verify's own length (below)
    decode  ->  one token per step on its full cache, until its max_new_tokens or a stop token; then it leaves

A request's committed tokens are those of :func:`lynxkv.speculative.run` on the same load with the same config
and the same drafts: the same first step (:func:`~lynxkv.speculative.model_ops.first_step`), the same forward
shapes per request, the same acceptance rules and the same order of draws from its own seeded generator. A
request whose residual fails or is late ends with its own error (or, with ``allow_anchor_only``, goes on
unverified on its anchor); the others are not affected. As in the single runner, a drafting request sits out
the steps while its residual is due within ``eta_guard`` of its draft step (its bytes are all in and the full
code is being built): a draft then could no longer be verified any sooner, and its forward would only take the
cores from that build, which runs at the lowest CPU priority (measured before the build went layer by layer: a
request drafting on to its window's end held its own full code back by up to 1.8 s).

The layered verify (:mod:`lynxkv.speculative.layered`, ``RunConfig.layered_verify`` None or True, a load with
``layer_in``, such as the progressive reader's): once a request has drafts and its residual is due within its
verify's own length (:func:`~lynxkv.speculative.layered.verify_estimate` in packed steps, learned from the
batch's own verifies), its verify joins the next step's forward on a cache shaped like its anchor's, and each
decoder layer takes that request's full code as it reaches the layer, waiting for it if need be. A forward that
waits holds up every request in it, so the verify starts only that close to the residual's end (drafting ended
by the window or a stop token does not start it early, as it does at batch 1), and its waits are bounded: a layer
later than the residual's estimate allowed (by ``patience``) gives up the layered pass, whose rows are dropped,
and the request drafts on (or waits) and verifies after its whole residual as without it. A step that waited is
left out of the draft-step times, and the verify's learned cost leaves every wait in the step out. A residual
that fails during the pass ends that request (or, with ``allow_anchor_only``, sends it on unverified on its
anchor) as it would without it.

The branch (``RunConfig.branch_margin``, greedy; :mod:`lynxkv.speculative.branch`): at a request's first draft
whose anchor margin is below the bound, a second chain forks from its runner-up token and drafts beside the main
chain, one more sequence of the request in each packed step (a fork of the draft cache: it copies the cache on its
first step). The main chain is verified in one pass; if that rejects exactly the fork's draft in favour of the
root, the request's next step feeds ``[root, branch drafts]`` on its full cache and keeps the branch's valid
prefix and the next token, the forward shapes ``decode_plain(..., first_forward=drafts, branch=(branch_at,
branch_token_ids))`` reproduces.

Not supported here (the single runner has them): ``verify_chunk`` and ``verify_first`` (a request that sets one is
refused), ``interrupt_drafts`` and ``dequantize_between_drafts`` (on by default; a batch does without them).
Times in each request's stats are seconds since its own arrival (when its load was opened).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from lynxkv.cache.loading import CacheLoad
from lynxkv.errors import InputError, LynxError, ResidualUnavailable
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative.branch import Brancher
from lynxkv.speculative.layered import LayeredVerify, decoder_layers, remember_verify, verify_estimate
from lynxkv.speculative.model_ops import check_kv, drop_last, first_step, start_cache
from lynxkv.speculative.packed import forward_packed
from lynxkv.speculative.runner import RunConfig, check_load, clip_tokens, is_finished
from lynxkv.speculative.sampling import accept_greedy, accept_sampled, choose, logits_to_probs
from lynxkv.speculative.stats import RunStats


@dataclass
class BatchRequest:
    """One request: its load (or a function that opens it at the arrival time), its config, new prompt tokens."""

    load: CacheLoad | Callable[[], CacheLoad]
    config: RunConfig = RunConfig()
    new_token_ids: list[int] | None = None
    arrival_s: float = 0.0  # seconds after the batch started
    name: str = ""


@dataclass
class RequestResult:
    name: str
    token_ids: list[int]
    stats: RunStats
    error: str | None = None  # why the request ended without its output (the others were not affected)
    arrival_s: float = 0.0

    @property
    def verified(self) -> bool:
        return self.error is None and self.stats.verified


@dataclass
class BatchResult:
    requests: list[RequestResult]
    steps: list[list[float]]  # [start, end, requests in the step, tokens in the step] per packed forward
    wall_s: float

    def aggregate(self) -> dict:
        tokens = sum(len(r.token_ids) for r in self.requests)
        sizes = [s[2] for s in self.steps]
        tt64 = [r.stats.tt(64) for r in self.requests if r.stats.tt(64) is not None]
        drafted = sum(r.stats.drafted for r in self.requests)
        accepted = sum(r.stats.accepted for r in self.requests)
        verify = [r.stats.verify_s for r in self.requests if r.stats.verify_s is not None]
        return {
            "requests": len(self.requests),
            "failed": sum(1 for r in self.requests if r.error is not None),
            "tokens": tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else None,
            "steps": len(self.steps),
            "mean_batch": statistics.fmean(sizes) if sizes else None,
            "max_batch": max(sizes) if sizes else 0,
            "step_s_median": statistics.median([e - s for s, e, *_ in self.steps]) if self.steps else None,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "verify_s_per_token": sum(verify) / accepted if accepted else None,
            "tt64_mean_s": statistics.fmean(tt64) if tt64 else None,
            "tt64_median_s": statistics.median(tt64) if tt64 else None,
        }


class _Request:
    """One request's state between steps: what it feeds the next packed forward and what it does with the rows."""

    def __init__(self, spec: BatchRequest, index: int, model, fingerprint: str):
        self.spec, self.index, self.model, self.fingerprint = spec, index, model, fingerprint
        self.cfg = spec.config
        self.name = spec.name or str(index)
        self.stats = RunStats()
        self.tokens: list[int] = []
        self.error: str | None = None
        self.phase = "arrive"
        self.load: CacheLoad | None = None
        self.gen = torch.Generator().manual_seed(self.cfg.seed) if self.cfg.seed is not None else None
        self.drafts: list[int] = []
        self.draft_probs: list[torch.Tensor] = []
        self.cache = None  # the cache the next forward runs on (anchor while drafting, full after the verify)
        self.pending: list[int] = []
        self.verified = True
        self.anchor_kv = None
        self.step_s: list[float] = []  # its draft steps' seconds (one token each), for the ETA guard
        self.layers = None  # its decoder layers for the layered verify (None: not known yet; False: none)
        self.lv: LayeredVerify | None = None  # its layered verify, while that is in the next forward
        self.draft_cache = None  # its anchor cache, kept while the layered verify runs on another
        self.draft_pending: list[int] | None = None  # what that cache's next forward would have fed
        self.draft_phase = "draft"  # the phase the layered verify started from ("draft" or "wait")
        self.brancher: Brancher | None = None  # its second draft chain (RunConfig.branch_margin)
        self.side = None  # the branch to verify in the next step, after the main chain rejected its fork's draft
        self.close_load = True  # close the load when the request is done with it (run_batch's close_loads)

    # ---- clock and commits ----------------------------------------------------------------------------------
    t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def commit(self, tokens: list[int]) -> None:
        tokens = clip_tokens(tokens, self.cfg.max_new_tokens - len(self.tokens), self.cfg.stop_token_ids)
        t = self.now()
        self.tokens.extend(tokens)
        self.stats.commit_times_s.extend([t] * len(tokens))
        if tokens and self.stats.first_commit_s is None:
            self.stats.first_commit_s = t

    def finished(self) -> bool:
        return is_finished(self.tokens, self.cfg.max_new_tokens, self.cfg.stop_token_ids)

    def fail(self, message: str) -> None:
        self.error, self.phase = message, "done"
        self.cache = None

    # ---- phases that need no forward --------------------------------------------------------------------------
    def advance(self, batch_t0: float) -> None:
        """Move through the phases that wait on the load (arrival, anchor, residual) as far as they are ready."""
        try:
            self._advance(batch_t0)
        except (LynxError, OSError) as exc:  # this request's own input: it ends, the others go on
            self.fail(str(exc))

    def _advance(self, batch_t0: float) -> None:
        cfg = self.cfg
        if self.phase == "arrive":
            if time.perf_counter() < batch_t0 + self.spec.arrival_s:
                return
            self.t0 = batch_t0 + self.spec.arrival_s  # its times count from its arrival, opening the load included
            spec_load = self.spec.load
            self.load = spec_load() if callable(spec_load) and not hasattr(spec_load, "wait_anchor") else spec_load
            self.load.residual.add_done_callback(self._on_residual)
            self.phase = "anchor"
        if self.phase == "anchor":
            try:
                self.anchor_kv = self.load.wait_anchor(0)
            except TimeoutError:
                if cfg.anchor_timeout is not None and self.now() > cfg.anchor_timeout:
                    raise LynxError(f"the anchor did not arrive within {cfg.anchor_timeout:g} s") from None
                return
            # when the anchor was in (the load's own record; this loop only sees it between steps)
            seen = self.load.timeline.anchor_ready_s
            self.stats.anchor_ready_s = self.now() if seen is None else min(seen, self.now())
            self.prompt = check_load(self.load, self.fingerprint)
            new = [int(t) for t in (self.spec.new_token_ids or ())]
            self.stats.cached_prompt_tokens = len(self.prompt)
            self.stats.prompt_tokens = len(self.prompt) + len(new)
            check_kv(self.anchor_kv, self.model.config, len(self.prompt), "anchor")
            self.keep, self.feed = first_step(self.prompt, new)
            self.cap = min(cfg.max_window, cfg.max_new_tokens) if cfg.speculate else 0
            self.stats.window_cap = self.cap
            self.phase = "wait"
            if self.cap and not self.load.residual.done():
                self.cache, self.pending, self.phase = start_cache(self.model, self.anchor_kv, self.keep), self.feed, "draft"
                wanted = cfg.layered_verify is not False and hasattr(self.load, "layer_in")
                self.layers = (wanted and decoder_layers(self.model, self.cache)) or False
                if cfg.branch_margin > 0:
                    self.brancher = Brancher(cfg.branch_margin, cfg.stop_token_ids)
        if self.phase == "draft" and (self.load.residual.done() or len(self.drafts) >= self.cap):
            self.phase = "wait"
            self._stop_drafting()
        eta = self._layered_due() if self.phase in ("draft", "wait") else None
        if eta is not None:
            self._start_layered(eta)
        if self.phase == "wait":
            self._take_residual()

    def _layered_due(self) -> float | None:
        """The residual's ETA when it is time to verify layer by layer from the next step on (it has drafts, two
        draft steps to judge a step by, and its residual, not yet in, is due within the verify's own length, less
        its last layer); else None."""
        if not (self.layers and self.drafts and len(self.step_s) >= 2) or self.load.residual.done():
            return None
        eta = self.load.residual_eta()
        if eta is None:
            return None
        step = statistics.median(self.step_s[1:])
        rows = len(self.feed) + len(self.drafts)
        return eta if eta < verify_estimate(self.model, rows, step, batch=True) * (1 - 1 / len(self.layers)) else None

    def _start_layered(self, eta: float) -> None:
        cfg = self.cfg
        step = statistics.median(self.step_s[1:])
        now = time.perf_counter()
        deadline = None if cfg.residual_timeout is None else self.t0 + cfg.residual_timeout
        # the residual's own estimate, with room for a late estimate: past that, a forward that waits on the layers
        # holds up the other requests for longer than verifying after the residual would cost this one
        patience = now + 2 * eta + 4 * step + 0.05
        self.draft_cache, self.draft_pending, self.draft_phase = self.cache, self.pending, self.phase
        self.cache = start_cache(self.model, self.anchor_kv, self.keep)  # the anchor's shapes; each layer replaced
        self.lv = LayeredVerify(self.load, self.cache, self.layers, self.keep, self.model.dtype, self.model.device,
                                deadline, soft=True, patience=patience)
        self.stats.drafted, self.stats.draft_token_ids = len(self.drafts), list(self.drafts)
        self._stop_drafting()
        self.pending, self.phase = self.feed + self.drafts, "verify"

    def holds(self) -> bool:
        """A drafting request sits this step out: its residual is due within ``eta_guard`` of its draft step. Its
        first draft step is not a typical one (its fresh cache moves into a buffer with room: the whole anchor
        copied), so the guard waits for a second and leaves the first out; judged on the first alone, a short
        residual held a request after one draft."""
        if self.phase != "draft" or len(self.step_s) < 2 or self.cfg.eta_guard <= 0:
            return False
        eta = self.load.residual_eta()
        if eta is None or eta >= self.cfg.eta_guard * statistics.fmean(self.step_s[1:]):
            return False
        self.stats.waited_on_eta = True
        return True

    def _on_residual(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is None and self.stats.residual_ready_s is None:
            self.stats.residual_ready_s = self.now()

    def _take_residual(self) -> None:
        cfg = self.cfg
        error = None
        try:
            full_kv = self.load.residual.result(timeout=0)
        except concurrent.futures.TimeoutError:
            if cfg.residual_timeout is None or self.now() < cfg.residual_timeout:
                return
            error = f"the residual did not arrive within {cfg.residual_timeout:g} s"
        except Exception as exc:  # the transport's failure, whatever its type
            error = f"the residual failed: {exc}"
        self.stats.drafted, self.stats.draft_token_ids = len(self.drafts), list(self.drafts)
        if error is not None:
            self._residual_failed(error)
            return
        self.stats.residual_seen_s = self.now()
        check_kv(full_kv, self.model.config, len(self.prompt), "full")
        self.cache = start_cache(self.model, full_kv, self.keep)  # the anchor cache goes with it
        self.pending, self.phase = self.feed + self.drafts, "verify"
        self._let_load_go()

    def _residual_failed(self, error: str) -> None:
        """The residual failed or is too late: the request ends with ``error``, or goes on unverified on its anchor
        cache (its drafts committed) when anchor-only output is allowed."""
        if not self.cfg.allow_anchor_only:
            raise ResidualUnavailable(f"{error} (allow anchor-only output to continue unverified on the anchor)")
        self.stats.verified, self.stats.residual_error, self.verified = False, error, False
        if self.brancher is not None:
            self._drop_branch()  # never verified
        if self.cache is None:
            self.cache, self.pending = start_cache(self.model, self.anchor_kv, self.keep), self.feed
        self.commit(self.drafts)
        self.phase = "done" if self.finished() else "decode"
        self._let_load_go()

    def _layered_ended(self, busy: float) -> bool:
        """After the forward of a layered verify (``busy``: its seconds less every layer wait in it): True when
        its rows are the verify's (every layer was filled); else its rows are dropped and the request goes back
        to drafting or waiting, to verify after its whole residual (a late layer), ends, or goes on on its
        anchor (the residual failed)."""
        lv, self.lv = self.lv, None
        if lv.failure is None:
            self.draft_cache = self.draft_pending = None
            self.stats.verify_layered, self.stats.verify_waited_s = True, lv.waited_s
            self.stats.residual_seen_s = lv.last_layer_s - self.t0
            if self.stats.residual_ready_s is None or self.stats.residual_seen_s < self.stats.residual_ready_s:
                self.stats.residual_ready_s = self.stats.residual_seen_s  # the last layer's arrival
            remember_verify(self.model, len(self.pending), busy, statistics.median(self.step_s[1:]), batch=True)
            self._let_load_go()
            return True
        self.cache, self.pending = self.draft_cache, self.draft_pending  # the anchor cache, as the drafting left it
        self.draft_cache = self.draft_pending = None
        if lv.late:  # as without the pass: drafting on if it was, then a verify after the whole residual
            self.layers, self.phase = False, self.draft_phase
            self.stats.verify_layered_abandoned = True
            given_up = getattr(self.load, "layers_given_up", None)
            if given_up is not None:  # the load goes back to building the rest of the full code early
                given_up()
            return False
        error = lv.failure
        if self.cfg.residual_timeout is not None and lv.deadline is not None and time.perf_counter() >= lv.deadline:
            error = f"the residual did not arrive within {self.cfg.residual_timeout:g} s"
        try:
            self._residual_failed(error)
        except LynxError as exc:
            self.fail(str(exc))
        return False

    def _let_load_go(self) -> None:
        """The cache holds all this request still needs of its load: keep the load's timeline, close the load
        and let it go, with the copies it holds (its anchor KV at once; its full code once the next forward has
        moved the cache into a buffer of its own), rather than when the request leaves: a request decoding
        would otherwise hold three copies of its KV instead of one."""
        self._close_load()
        self.stats.load = _timeline(self.load)
        self.load = self.anchor_kv = None

    def _close_load(self) -> None:
        """Close the load (unless run_batch was told not to). A load that fails to close (a file or a socket that
        errs) ends nothing: its request holds all it needs, or has already ended, and the other requests go on; the
        error is kept in the load's timeline, ``extra["close_error"]``."""
        if not self.close_load:
            return
        try:
            self.load.close()
        except (OSError, LynxError) as exc:
            self.load.timeline.extra["close_error"] = str(exc)

    # ---- the next forward ---------------------------------------------------------------------------------------
    def sequences(self) -> list[tuple[object, list[int]]]:
        """``(cache, tokens)`` of each sequence this request feeds the next forward: its chain, and while it drafts
        its branch's next token on the branch's cache."""
        out = [(self.cache, self.pending)]
        b = self.brancher.branch if self.brancher is not None and self.phase == "draft" else None
        if b is not None and not b.ended and b.cache is not None:  # (its cache goes when drafting ends once)
            out.append((b.cache, b.tokens[-1:]))
        return out

    # ---- after a forward ----------------------------------------------------------------------------------------
    def take_rows(self, rows: torch.Tensor, start: float, end: float, side: torch.Tensor | None = None,
                  waited: float = 0.0) -> None:
        """Use this request's logits ``[len(pending), V]`` of the step that ran ``[start, end]`` (perf_counter),
        and its branch's row ``side`` when the step ran the branch too; ``waited``: how long the step's layered
        verifies waited for layers (not compute: such a step is no measure of a step)."""
        params = self.cfg.sampling
        ts, te = start - self.t0, end - self.t0
        if self.phase == "draft":
            if side is not None:  # the branch's next greedy token
                b = self.brancher.branch
                b.tokens.append(int(side[-1].argmax()))
                b.ended = b.tokens[-1] in self.brancher.stops
                self.stats.branch_draft_steps.append([ts, te])
            if self.brancher is not None:  # fork here if the anchor is unsure (before this step's token is fed)
                self.brancher.consider(rows[-1], self.cache, len(self.drafts))
            token, probs = choose(rows[-1], params, self.gen)
            self.stats.draft_steps.append([ts, te])
            if len(self.pending) == 1 and not waited:  # a draft step (a first forward over new tokens: a prefill)
                self.step_s.append(end - start)
            self.drafts.append(token)
            if probs is not None:
                self.draft_probs.append(probs)
            if self.stats.first_draft_s is None:
                self.stats.first_draft_s = self.now()
            self.pending = [token]
            if token in self.cfg.stop_token_ids or len(self.drafts) >= self.cap:
                self.phase = "wait"
        elif self.phase == "verify":
            if self.lv is not None and not self._layered_ended(end - start - waited):
                return
            k = len(self.drafts)
            rows = rows[len(self.feed) - 1 :]  # [k+1, V]
            if params.greedy:
                accepted, next_token = accept_greedy(self.drafts, rows)
            else:
                q = torch.stack(self.draft_probs) if k else rows[:0]  # [k, V]
                accepted, next_token = accept_sampled(self.drafts, q, logits_to_probs(rows, params), self.gen)
            self.stats.verify_start_s, self.stats.verify_end_s, self.stats.verify_s = ts, te, te - ts
            self.stats.verify_passes, self.stats.verify_pass_sizes, self.stats.accepted = 1, [k], accepted
            drop_last(self.cache, k - accepted)
            self.draft_probs.clear()
            self.commit(self.drafts[:accepted])
            if not self.finished():
                self.commit([next_token])
            self.side = self._drop_branch().to_verify(accepted, next_token) if self.brancher is not None else None
            if self.side is not None and not self.finished():  # rejected at the fork, for the branch's root
                self.pending, self.phase = list(self.side.tokens), "branch"
            else:
                self.side, self.pending, self.phase = None, [next_token], "decode"
        elif self.phase == "branch":  # [root, b0, b1, ..] on the full cache
            drafts = self.side.tokens[1:]
            accepted, next_token = accept_greedy(drafts, rows)
            self.stats.branch_accepted, self.stats.branch_verify_s = accepted, te - ts
            drop_last(self.cache, len(drafts) - accepted)
            self.side = None
            self.commit(drafts[:accepted])
            if not self.finished():
                self.commit([next_token])
            self.pending, self.phase = [next_token], "decode"
        else:  # decode, on the full cache or (unverified) on the anchor cache
            length = int(self.cache.get_seq_length()) - len(self.pending)
            token, _ = choose(rows[-1], params, self.gen)
            if len(self.pending) == 1:
                self.stats.decode_steps.append([ts, te, length])
            self.commit([token])
            self.pending = [token]
        if self.phase in ("verify", "branch", "decode") and self.finished():
            self.phase, self.cache = "done", None
        if self.phase == "wait":
            self._stop_drafting()

    def _drop_branch(self) -> Brancher:
        """The brancher, taken from the request (its branch's cache goes with it), its stats noted."""
        brancher, self.brancher = self.brancher, None
        brancher.record(self.stats)
        return brancher

    def _stop_drafting(self) -> None:
        """Drafting is over: its step time noted, and the branch's cache let go (its verify needs its tokens)."""
        if self.brancher is not None and self.brancher.branch is not None:
            self.brancher.branch.cache = None
        steps = [e - s for s, e in self.stats.draft_steps]
        if steps:
            self.stats.draft_step_s = statistics.median(steps[1:] or steps)

    def result(self) -> RequestResult:
        decode = [e - s for s, e, _ in self.stats.decode_steps]
        if decode:
            self.stats.decode_step_s = statistics.median(decode)
        self.stats.drafted = len(self.drafts)
        self.stats.draft_token_ids = list(self.drafts)
        return RequestResult(self.name, self.tokens, self.stats, self.error, self.spec.arrival_s)

    def leave(self) -> None:
        """The request is over: keep its load's timeline, close the load (if it still has it) and let its caches
        go."""
        if self.load is not None:
            self._close_load()
            self.stats.load = _timeline(self.load)
        self.load = self.cache = self.anchor_kv = self.draft_cache = self.lv = self.side = None
        if self.brancher is not None:
            self._drop_branch()
        self.draft_probs.clear()


def run_batch(model, requests: list[BatchRequest], *, fingerprint: str | None = None, max_batch: int | None = None,
              on_step: Callable[[list[RequestResult]], None] | None = None, close_loads: bool = True) -> BatchResult:
    """Decode every request, all of them together (see the module docstring); results in the order given.

    ``max_batch`` caps how many requests are open at once (loading, drafting, verifying or decoding): the next
    to arrive is admitted, and its load opened, only when one of them has left, so memory holds at most
    ``max_batch`` requests' caches whatever the number of requests; its times still count from its arrival.
    ``on_step(partial results)`` is called after every step (a progress display). Each load is closed when its
    request is done with it (its cache holds its full code, or the request ended) unless ``close_loads`` is False;
    either way the request lets it go then, with the KV copies only the load holds.
    """
    for i, spec in enumerate(requests):
        cfg = spec.config
        named = [name for name, on in (("verify_chunk", cfg.verify_chunk), ("verify_first", cfg.verify_first))
                 if on]
        if named:
            raise InputError(f"request {spec.name or i}: {', '.join(named)}: the single runner's only "
                             "(lynxkv.speculative.run), not in a batch")
    fingerprint = fingerprint or model_fingerprint(model)
    reqs = [_Request(spec, i, model, fingerprint) for i, spec in enumerate(requests)]
    for r in reqs:
        r.close_load = close_loads
    t0 = time.perf_counter()
    steps: list[list[float]] = []
    try:
        while True:
            opened = sum(1 for r in reqs if r.phase not in ("arrive", "done"))
            for r in reqs:
                if r.phase == "arrive" and max_batch is not None and opened >= max_batch:
                    continue  # it waits to be admitted: nothing of it is loaded before there is room
                if r.phase != "done":
                    arriving = r.phase == "arrive"
                    r.advance(t0)
                    opened += arriving and r.phase not in ("arrive", "done")
                    if r.phase == "done":
                        r.leave()
            live = [r for r in reqs if r.phase != "done"]
            if not live:
                break
            ready = [r for r in live if r.phase in ("draft", "verify", "branch", "decode") and not r.holds()]
            if max_batch is not None:
                ready = ready[:max_batch]
            if not ready:
                _idle(live, t0)
                continue
            start = time.perf_counter()
            with contextlib.ExitStack() as layered:  # the layered verifies' hooks fill their layers as they land
                for r in ready:
                    if r.lv is not None:
                        layered.enter_context(r.lv.installed())
                seqs = [r.sequences() for r in ready]
                rows = forward_packed(model, [c for s in seqs for c, _ in s], [t for s in seqs for _, t in s])
            end = time.perf_counter()
            steps.append([start - t0, end - t0, len(ready), sum(len(t) for s in seqs for _, t in s)])
            waited = sum(r.lv.waited_s for r in ready if r.lv is not None)  # the whole step waited on these
            at = 0
            for r, s in zip(ready, seqs):
                x, side = rows[at], rows[at + 1] if len(s) > 1 else None
                at += len(s)
                r.take_rows(x, start, end, side, waited)
                if r.phase == "done":
                    r.leave()
            if on_step is not None:
                on_step([r.result() for r in reqs])
    finally:
        for r in reqs:
            r.leave()
    return BatchResult([r.result() for r in reqs], steps, time.perf_counter() - t0)


def _timeline(load) -> dict:
    """The load's timeline as a dict, taken once the request is done with the load: a load not closed (or one
    whose workers outlived close's wait) may still be adding to ``extra``, which is copied first, in one step."""
    timeline = load.timeline
    return asdict(replace(timeline, extra=dict(timeline.extra)))


def _idle(live: list[_Request], t0: float) -> None:
    """Nothing to compute: sleep until a residual lands, an anchor may be in, or the next request arrives."""
    now = time.perf_counter()
    arrivals = [t0 + r.spec.arrival_s - now for r in live if r.phase == "arrive"]
    timeout = min([0.01] + [max(0.0, a) for a in arrivals])
    futures = [r.load.residual for r in live if r.phase in ("wait", "draft") and r.load is not None]
    if futures:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    else:
        time.sleep(timeout)
