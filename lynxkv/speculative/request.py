"""One request's state machine: what it feeds the engine's next forward, and what it does with the rows.

    arrive  ->  its load opened (at its arrival time)
    anchor  ->  waiting for the anchor; then the cache's identity is checked, and the request drafts, or waits for
                the residual when drafting cannot pay (Timing.wait_reason: due within a few decode steps)
    draft   ->  its last token on its anchor cache, one token a step, until its residual is in (its bytes, alone),
                its window is full or a stop token is drafted; it sits a step out while its residual is due within
                ETA_GUARD of a draft step
    wait    ->  waiting for the residual (its full code); or, once the residual is due within the verify's own
                length (Timing.verify_estimate), the verify starts on a cache shaped like the anchor's and each
                decoder layer takes its full code as the forward reaches it (lynxkv.speculative.layered)
    verify  ->  ONE forward over [fed prompt tokens, d0 .. d(k-1)] on the full cache; accept the longest valid prefix
                (greedy: argmax match; sampling: min(1, p/q) and the residual distribution), commit, drop the rest
    branch  ->  greedy, when the verify rejected exactly the fork's draft in favour of the branch's root: ONE forward
                over [root, b0, b1, ..] on the same cache keeps the branch's valid prefix (lynxkv.speculative.branch)
    decode  ->  one token a step on its full cache (or, unverified, on its anchor cache after a residual failure)
    done

A request alone (``lynxkv run a.lynx``) also ends a draft forward part-way when its residual lands, dequantizes
landed residual layers between its draft steps, stops drafting once every residual byte is in, and starts the
layered verify as soon as drafting ends; in a batch those would take the cores or the forward from the others.
"""

from __future__ import annotations

import concurrent.futures
import math
import statistics
import time

import torch

from lynxkv.cache.loading import CacheLoad
from lynxkv.errors import InputError, LynxError, ResidualUnavailable
from lynxkv.speculative.branch import Brancher
from lynxkv.speculative.config import (BRANCH_MARGIN, ETA_GUARD, Event, RequestResult, check_load, clip_tokens,
                                       is_finished)
from lynxkv.speculative.interrupt import DraftInterrupt, Superseded
from lynxkv.speculative.layered import LayeredVerify, decoder_layers
from lynxkv.speculative.model_ops import check_kv, drop_last, first_step, forward_tokens, start_cache, trim_to
from lynxkv.speculative.packed import shares_prefix
from lynxkv.speculative.sampling import accept_greedy, accept_sampled, choose, logits_to_probs
from lynxkv.speculative.stats import RunStats

FORWARD_PHASES = ("draft", "verify", "branch", "decode")


class Request:
    """One request's state between the engine's steps (see the module docstring)."""

    def __init__(self, spec, index: int, model, fingerprint: str, timing, *, alone: bool, provisional: bool = False):
        self.spec, self.index, self.model, self.fingerprint, self.timing = spec, index, model, fingerprint, timing
        self.alone, self.provisional = alone, provisional
        self.cfg = spec.config
        self.name = spec.name or str(index)
        self.stats = RunStats()
        self.tokens, self.events = [], []  # list[int], list[Event]
        self.error: str | None = None
        self.exc: BaseException | None = None  # the error as raised (a run alone re-raises it)
        self.phase = "arrive"
        self.load: CacheLoad | None = None
        # on the model's device, where the probabilities it samples from are (the same seed: the same tokens there)
        self.gen = (torch.Generator(device=model.device).manual_seed(self.cfg.seed) if self.cfg.seed is not None
                    else None)
        self.drafts, self.draft_probs = [], []  # list[int], list[torch.Tensor]
        self.cache = None  # the cache the next forward runs on (anchor while drafting, full after the verify)
        self.pending: list[int] = []
        self.verified, self.anchor_kv = True, None
        self.step_s: list[float] = []  # its draft steps' seconds (one token each)
        self.layers = None  # its decoder layers for the layered verify (None: not known yet; False: none)
        self.lv: LayeredVerify | None = None  # its layered verify, while that is in the next forward
        self.draft_cache = None  # its anchor cache, kept while the layered verify runs on another
        self.draft_pending: list[int] | None = None  # what that cache's next forward would have fed
        self.draft_phase = "draft"  # the phase the layered verify started from ("draft" or "wait")
        self.brancher: Brancher | None = None
        self.side = None  # the branch to verify in the next step, after the main chain rejected its fork's draft
        self.interrupt: DraftInterrupt | None = None
        self.close_load = True
        self.noted = False  # its decode step was handed to the timing
        self.t0 = 0.0

    # ---- clock, commits, events -----------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def commit(self, tokens: list[int], confirmed: int = 0) -> None:
        tokens = clip_tokens(tokens, self.cfg.max_new_tokens - len(self.tokens), self.cfg.stop_token_ids)
        if not tokens:
            return
        t = self.now()
        self.tokens.extend(tokens)
        self.stats.commit_times_s.extend([t] * len(tokens))
        if self.stats.first_commit_s is None:
            self.stats.first_commit_s = t
        self.events.append(Event("commit", t, tokens=tokens, confirmed=min(confirmed, len(tokens)),
                                 verified=self.verified))

    def finished(self) -> bool:
        return is_finished(self.tokens, self.cfg.max_new_tokens, self.cfg.stop_token_ids)

    def fail(self, exc: BaseException) -> None:
        self.error, self.exc, self.phase = str(exc), exc, "done"
        self.cache = None

    # ---- phases that need no forward ----------------------------------------------------------------------------
    def advance(self, engine_t0: float) -> None:
        """Move through the phases that wait on the load (arrival, anchor, residual) as far as they are ready."""
        try:
            self._advance(engine_t0)
        except (LynxError, OSError) as exc:  # this request's own input: it ends, the others go on
            self.fail(exc)

    def _advance(self, engine_t0: float) -> None:
        if self.phase == "arrive":
            if time.perf_counter() < engine_t0 + self.spec.arrival_s:
                return
            self.t0 = engine_t0 + self.spec.arrival_s  # its times count from its arrival, opening the load included
            load = self.spec.load
            self.load = load if isinstance(load, CacheLoad) else load()
            if not isinstance(self.load, CacheLoad):
                raise InputError(f"request {self.name}: {type(self.load).__name__} is not a CacheLoad")
            self.load.residual.add_done_callback(self._on_residual)
            self.phase = "anchor"
        if self.phase == "anchor":
            self._take_anchor()
        if self.phase == "draft" and (self.load.residual.done() or len(self.drafts) >= self.cap
                                      or (self.alone and self.load.residual_in())):
            self._stop_drafting("wait")
        eta = self._layered_due() if self.phase in ("draft", "wait") else None
        if eta is not None:
            self._start_layered(eta)
        if self.phase == "wait":
            self._take_residual()

    def _take_anchor(self) -> None:
        cfg = self.cfg
        try:
            self.anchor_kv = self.load.wait_anchor(0)
        except TimeoutError:
            if cfg.anchor_timeout is not None and self.now() > cfg.anchor_timeout:
                raise LynxError(f"the anchor did not arrive within {cfg.anchor_timeout:g} s") from None
            return
        seen = self.load.timeline.anchor_ready_s  # the load's own record: the engine sees it only between steps
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
            self.stats.drafting_disabled = self.timing.wait_reason(self.load.residual_eta(), self.stats.prompt_tokens)
            if self.stats.drafting_disabled:
                self.cap = 0
        if self.cap and not self.load.residual.done():
            adopt = self.load.grow_in_place
            self.cache, self.pending, self.phase = start_cache(self.model, self.anchor_kv, self.keep, adopt=adopt), \
                self.feed, "draft"
            self.layers = (self.load.streams_layers and decoder_layers(self.model, self.cache)) or False
            if cfg.sampling.greedy:
                shared = self.alone and shares_prefix(self.model)  # a batch packs the branch as its own sequence
                self.brancher = Brancher(BRANCH_MARGIN, cfg.stop_token_ids, shared=shared)
            if self.alone:  # it builds the landed layers itself, between its steps (dequantize_landed)
                self.interrupt = DraftInterrupt(self.model, self.load.residual, also=self.load.residual_in)
                self.load.hold_early(True)

    def _layered_due(self) -> float | None:
        """The residual's ETA when it is time to verify layer by layer from the next step on, else None. Alone, that
        is as soon as drafting has ended with drafts and the residual is not in; otherwise once the residual is due
        within the verify's own length, less its last layer (two draft steps to judge a step by)."""
        if not (self.layers and self.drafts) or self.load.residual.done():
            return None
        eta = self.load.residual_eta()
        if self.alone and self.phase == "wait":
            return math.inf if eta is None else eta
        if eta is None or len(self.step_s) < 2:
            return None
        step = statistics.median(self.step_s[1:])
        rows = len(self.feed) + len(self.drafts)
        due = self.timing.verify_estimate(rows, step, batch=not self.alone) * (1 - 1 / len(self.layers))
        return eta if eta < due else None

    def _start_layered(self, eta: float) -> None:
        cfg = self.cfg
        deadline = None if cfg.residual_timeout is None else self.t0 + cfg.residual_timeout
        patience = None
        if not self.alone:  # past the estimate (with room), a waiting forward holds the others up too long
            step = statistics.median(self.step_s[1:])
            patience = time.perf_counter() + 2 * eta + 4 * step + 0.05
        self.draft_cache, self.draft_pending, self.draft_phase = self.cache, self.pending, self.phase
        self.cache = start_cache(self.model, self.anchor_kv, self.keep)  # the anchor's shapes; each layer replaced
        self.lv = LayeredVerify(self.load, self.cache, self.layers, self.keep, self.model.dtype, self.model.device,
                                deadline, soft=True, patience=patience, adopt=self.load.grow_in_place)
        self._stop_drafting("verify")
        self.pending, self.stats.verify_layered = self.feed + self.drafts, True

    def holds(self) -> bool:
        """A drafting request sits this step out: its residual is due within ``ETA_GUARD`` of its draft step
        (judged from its second step on: the first, on a fresh cache, is not a typical one)."""
        if self.phase != "draft" or len(self.step_s) < 2:
            return False
        eta = self.load.residual_eta()
        if eta is None or eta >= ETA_GUARD * statistics.fmean(self.step_s[1:]):
            return False
        self.stats.waited_on_eta = True
        return True

    def _on_residual(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is None:
            t = self.now()  # a layered verify may have noted its last layer first
            self.stats.residual_ready_s = t if self.stats.residual_ready_s is None else min(t, self.stats.residual_ready_s)

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
        if error is not None:
            self._residual_failed(error)
            return
        self.stats.residual_seen_s = self.now()
        check_kv(full_kv, self.model.config, len(self.prompt), "full")
        self.cache = start_cache(self.model, full_kv, self.keep, adopt=self.load.grow_in_place)
        self.draft_cache = self.draft_pending = None
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
        self.commit(self.drafts, confirmed=len(self.drafts))
        self.phase = "done" if self.finished() else "decode"
        self._let_load_go()

    def _layered_ended(self, busy: float) -> bool:
        """After the forward of a layered verify (``busy``: its seconds less every layer wait in it): True when its
        rows are the verify's (every layer was filled); else they are dropped and the request drafts on or waits,
        to verify after its whole residual (a late layer), ends, or goes on on its anchor (the residual failed)."""
        lv, self.lv = self.lv, None
        if lv.failure is None:
            self.draft_cache = self.draft_pending = None
            self.stats.verify_waited_s = lv.waited_s
            self.stats.residual_seen_s = lv.last_layer_s - self.t0
            if self.stats.residual_ready_s is None or self.stats.residual_seen_s < self.stats.residual_ready_s:
                self.stats.residual_ready_s = self.stats.residual_seen_s  # the last layer's arrival
            if len(self.step_s) >= 2:
                self.timing.note_verify(len(self.pending), busy, statistics.median(self.step_s[1:]),
                                        batch=not self.alone)
            self._let_load_go()
            return True
        self.cache, self.pending = self.draft_cache, self.draft_pending  # the anchor cache, as the drafting left it
        self.draft_cache = self.draft_pending = None
        if lv.late:  # as without the pass: drafting on if it was, then a verify after the whole residual
            self.layers, self.phase = False, self.draft_phase
            self.stats.verify_layered, self.stats.verify_layered_abandoned = False, True
            self.load.layers_given_up()
            return False
        error = lv.failure
        if self.cfg.residual_timeout is not None and lv.deadline is not None and time.perf_counter() >= lv.deadline:
            error = f"the residual did not arrive within {self.cfg.residual_timeout:g} s"
        try:
            self._residual_failed(error)
        except LynxError as exc:
            self.fail(exc)
        return False

    def _let_load_go(self) -> None:
        """The cache holds all the request needs of its load: close the load and let its KV copies go now."""
        self._close_load()
        self.stats.load = self.load.timeline.as_dict()
        self.load = self.anchor_kv = None

    def _close_load(self) -> None:
        """Close the load (unless told not to); a failure to close ends nothing (``extra["close_error"]``)."""
        if not self.close_load:
            return
        try:
            self.load.close()
        except (OSError, LynxError) as exc:
            self.load.timeline.extra["close_error"] = str(exc)

    # ---- the next forward ---------------------------------------------------------------------------------------
    def sequences(self) -> list[tuple[object, list[int]]]:
        """``(cache, tokens)`` of each sequence it feeds a packed forward: its chain, and its branch's next token."""
        out = [(self.cache, self.pending)]
        b = self.brancher.branch if self.brancher is not None and self.phase == "draft" else None
        if b is not None and not b.ended and b.cache is not None:
            out.append((b.cache, b.tokens[-1:]))
        return out

    def forward_alone(self) -> torch.Tensor | None:
        """This request's forward when it is the only one in the step: its rows, or None when a draft forward was
        ended part-way by the residual's arrival (its cache is put back as it was before the step)."""
        if self.phase != "draft":
            return forward_tokens(self.model, self.cache, self.pending)
        step = forward_tokens if self.brancher is None else self.brancher.forward
        before = int(self.cache.get_seq_length())
        self.interrupt.install()  # once per draft phase: _stop_drafting and leave take the hooks off
        try:
            return self.interrupt.run(step, self.model, self.cache, self.pending)
        except Superseded:
            # Some layers took the step's token, the others not: the anchor-only fallback must see a whole cache
            trim_to(self.cache, before)
            self.stats.drafts_abandoned += 1
            self._stop_drafting("wait")
            return None

    # ---- after a forward ----------------------------------------------------------------------------------------
    def take_rows(self, rows: torch.Tensor, start: float, end: float, side: torch.Tensor | None = None,
                  waited: float = 0.0) -> None:
        """Use this request's logits ``[len(pending), V]`` of the step that ran ``[start, end]`` (perf_counter),
        and its branch's row ``side`` when a packed step ran the branch too; ``waited``: how long the step's
        layered verifies waited for layers (such a step is no measure of a step)."""
        if self.phase == "draft":
            self._drafted(rows, start, end, side, waited)
        elif self.phase == "verify":
            if self.lv is not None and not self._layered_ended(end - start - waited):
                return
            self._verified(rows[len(self.feed) - 1 :], start, end)
        elif self.phase == "branch":  # [root, b0, b1, ..] on the full cache
            drafts = self.side.tokens[1:]
            accepted, next_token = accept_greedy(drafts, rows)
            self.stats.branch_accepted, self.stats.branch_verify_s = accepted, end - start
            drop_last(self.cache, len(drafts) - accepted)
            self.side = None
            self.commit(drafts[:accepted])
            if not self.finished():
                self.commit([next_token])
            self.pending, self.phase = [next_token], "decode"
        else:  # decode, on the full cache or (unverified) on the anchor cache
            length = int(self.cache.get_seq_length()) - len(self.pending)
            token, _ = choose(rows[-1], self.cfg.sampling, self.gen)
            if len(self.pending) == 1:
                self.stats.decode_steps.append([start - self.t0, end - self.t0, length])
            self.commit([token])
            self.pending = [token]
        if self.phase in ("verify", "branch", "decode") and self.finished():
            self.phase, self.cache = "done", None

    def _drafted(self, rows, start: float, end: float, side, waited: float) -> None:
        if side is not None:  # the branch's next greedy token, from a packed step
            b = self.brancher.branch
            b.tokens.append(int(side[-1].argmax()))
            b.ended = b.tokens[-1] in self.brancher.stops
        if self.brancher is not None and (side is not None or self.brancher.packed_last):
            self.stats.branch_draft_steps.append([start - self.t0, end - self.t0])
        if self.brancher is not None:  # fork here if the anchor is unsure (before this step's token is fed)
            self.brancher.consider(rows[-1], self.cache, len(self.drafts))
        token, probs = choose(rows[-1], self.cfg.sampling, self.gen)
        self.stats.draft_steps.append([start - self.t0, end - self.t0])
        if len(self.pending) == 1 and not waited:  # a draft step (a first forward over new tokens: a prefill)
            self.step_s.append(end - start)
        self.drafts.append(token)
        if probs is not None:
            self.draft_probs.append(probs)
        if self.stats.first_draft_s is None:
            self.stats.first_draft_s = self.now()
        if self.stats.window_planned is None and self.step_s:
            eta = self.load.residual_eta()
            if eta is not None:
                self.stats.window_planned = min(self.cap, len(self.drafts) + math.ceil(eta / max(self.step_s[0], 1e-9)))
        self.pending = [token]
        if self.provisional:
            self.events.append(Event("draft", self.now(), tokens=[token]))
        if self.alone:
            self.stats.layers_dequantized_between_drafts += self.load.dequantize_landed()
        if token in self.cfg.stop_token_ids or len(self.drafts) >= self.cap:
            self._stop_drafting("wait")

    def _verified(self, rows: torch.Tensor, start: float, end: float) -> None:
        """The verify's rows ``[k+1, V]``: accept, commit, drop the rejected drafts from the cache."""
        params, k = self.cfg.sampling, len(self.drafts)
        if params.greedy:
            accepted, next_token = accept_greedy(self.drafts, rows)
        else:
            q = torch.stack(self.draft_probs) if k else rows[:0]  # [k, V]
            accepted, next_token = accept_sampled(self.drafts, q, logits_to_probs(rows, params), self.gen)
        ts, te = start - self.t0, end - self.t0
        self.stats.verify_start_s, self.stats.verify_end_s, self.stats.verify_s = ts, te, te - ts
        self.stats.verify_passes, self.stats.accepted = 1, accepted
        drop_last(self.cache, k - accepted)
        self.draft_probs.clear()
        self.commit(self.drafts[:accepted], confirmed=accepted)
        if self.provisional and k > accepted:
            self.events.append(Event("retract", self.now(), count=k - accepted))
        if not self.finished():
            self.commit([next_token])
        self.side = self._drop_branch().to_verify(accepted, next_token) if self.brancher is not None else None
        if self.side is not None and not self.finished():  # rejected at the fork, for the branch's root
            self.pending, self.phase = list(self.side.tokens), "branch"
        else:
            self.side, self.pending, self.phase = None, [next_token], "decode"

    def _drop_branch(self) -> Brancher:  # (its branch's cache goes with it; its stats are noted)
        brancher, self.brancher = self.brancher, None
        brancher.record(self.stats)
        return brancher

    def _stop_drafting(self, phase: str) -> None:
        """Drafting is over: on to ``phase``; its steps and drafts noted, the branch's cache let go."""
        was_drafting = self.phase == "draft"
        self.phase = phase
        if self.interrupt is not None:
            self.interrupt.remove()
        if self.brancher is not None and self.brancher.branch is not None:
            self.brancher.branch.cache = None
        self.stats.drafted, self.stats.draft_token_ids = len(self.drafts), list(self.drafts)
        steps = [e - s for s, e in self.stats.draft_steps]
        if steps:
            self.stats.draft_step_s = statistics.median(steps[1:] or steps)
            if len(self.feed) == 1:  # the first draft forward grew the fresh anchor cache
                self.stats.first_draft_step_s = steps[0]
        if was_drafting and self.alone and phase == "wait" and self.load is not None:
            self.load.hold_early(False)  # waiting for the whole residual: the load's worker takes the idle cores

    def result(self) -> RequestResult:
        decode = [e - s for s, e, _ in self.stats.decode_steps]
        if decode:
            self.stats.decode_step_s = statistics.median(decode)
        self.stats.drafted, self.stats.draft_token_ids = len(self.drafts), list(self.drafts)
        return RequestResult(self.name, self.tokens, self.stats, self.error, self.spec.arrival_s)

    def leave(self) -> None:  # the request is over: its load closed (if it still has it), its caches let go
        if self.load is not None:
            self._close_load()
            self.stats.load = self.load.timeline.as_dict()
        steps = self.stats.decode_steps
        if steps and not self.noted:  # this machine's decode step, for the next request's draft-or-wait rule
            self.noted = True
            self.timing.note_step(steps[len(steps) // 2][2], statistics.median(e - s for s, e, _ in steps))
        self.load = self.cache = self.anchor_kv = self.draft_cache = self.lv = self.side = None
        if self.interrupt is not None:  # a request that left while drafting (it failed, or the run was stopped)
            self.interrupt.remove()
        if self.brancher is not None:
            self._drop_branch()
        self.draft_probs.clear()
