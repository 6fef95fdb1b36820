"""The Lynx decode loop: draft on the anchor while the residual streams, verify once, continue on the full cache.

    open  ->  wait_anchor()  ->  start_cache(anchor KV, T-1) ; feed the last prompt token, or, with new prompt
              tokens n0 .. n(m-1) after the cached prompt: start_cache(anchor KV, T) ; feed [n0 .. n(m-1)]
              (the new tokens are prefilled on the anchor cache; model_ops.first_step)
    draft ->  d0, d1, ... (each from the anchor cache, greedy or sampled, keeping its distribution)
              until the residual is complete, the window cap is hit, or the residual is due within a fraction
              of a draft step (its ETA from the transport); with a load that hands out the full code layer by
              layer, until the residual is due within the verify's own length: the verify then runs layer by
              layer as the rest lands (lynxkv.speculative.layered), as it does whenever drafting ends before the
              residual is in (the window cap, a stop token)
    verify -> the same start on the full KV ; ONE forward over [fed tokens, d0 .. d(k-1)] -> the last k+1
              rows of logits; accept the longest valid prefix (greedy: argmax match; sampling: min(1, p/q)), then
              the correction / bonus token from the target; drop the rejected tokens from the cache
    decode -> plain decoding on the full cache until max_new_tokens or a stop token

The committed tokens are those of plain decoding on the full cache (greedy: token for token; sampling: in
distribution), with "plain decoding" defined by :func:`decode_plain`. A residual that fails or times out raises
:class:`ResidualUnavailable` unless the caller asked for ``allow_anchor_only``, in which case the output
continues on the anchor cache and is flagged unverified.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import operator
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from lynxkv.errors import InputError, LynxError, ResidualUnavailable
from lynxkv.cache.kv import KVPairs
from lynxkv.cache.loading import CacheLoad
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative.interrupt import DraftInterrupt, Superseded
from lynxkv.speculative.layered import LayeredVerify, decoder_layers, remember_verify, verify_estimate
from lynxkv.speculative.branch import Brancher, verify_branch
from lynxkv.speculative.model_ops import check_kv, drop_last, first_step, forward_tokens, start_cache
from lynxkv.speculative.packed import shares_prefix
from lynxkv.speculative.sampling import SamplingParams, choose
from lynxkv.speculative.schedule import MIN_WINDOW_STEPS, AcceptanceTracker, remember_step, wait_reason
from lynxkv.speculative.stats import RunStats
from lynxkv.speculative.verify_pass import cut_at, pass_sizes, verify_drafts


@dataclass(frozen=True)
class RunConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None  # sampling RNG seed (None: nondeterministic)
    speculate: bool = True  # False: wait for the residual, then decode plainly (the monolithic baseline)
    max_window: int = 64  # cap on drafted tokens
    eta_guard: float = 0.5  # stop drafting when the residual is due within this fraction of a draft step
    anchor_timeout: float | None = None  # seconds from the start
    residual_timeout: float | None = None  # seconds from the start
    allow_anchor_only: bool = False  # on residual failure, continue unverified on the anchor (flagged)
    stop_token_ids: tuple[int, ...] = ()
    # 0: verify every draft in one forward; n > 0: passes of n, 2n, ... drafts (see verify_pass.verify_drafts)
    verify_chunk: int = 0
    # The first pass of the verify takes only this many drafts, whose tokens are committed at once, and a second
    # pass the rest (pass_sizes): the first tokens come about a decode step after the residual instead of a whole
    # verify after it, for one more forward's fixed cost. 0: one pass.
    verify_first: int = 0
    # Start the verify while the residual still arrives, each layer once its own residual is in
    # (lynxkv.speculative.layered; needs a load with layer_in/full_layer, such as the progressive reader's).
    # None (the default): on unless verify_chunk or verify_first asks for another shape of verify; True: on (the
    # layered pass is the first); False: off. In a batch (lynxkv.speculative.batch) None and True are on.
    layered_verify: bool | None = None
    # Draft only where it can pay (lynxkv.speculative.schedule): wait for the residual instead when, at anchor-ready,
    # it is due within this many decode steps. 0: always draft.
    min_window_steps: float = MIN_WINDOW_STEPS
    step_estimate_s: float | None = None  # a decode step's seconds at this cache length (None: from earlier runs)
    # End the draft forward under way when the residual lands rather than wait for its token, which would come too
    # late to be verified (lynxkv.speculative.interrupt). LYNXKV_INTERRUPT_DRAFTS=0 turns it off.
    interrupt_drafts: bool = field(default_factory=lambda: os.environ.get("LYNXKV_INTERRUPT_DRAFTS", "1") != "0")
    # Between draft steps, dequantize the residual's layers that have landed, in the runner's own thread; stop
    # drafting once every residual byte is in. LYNXKV_DEQUANT_BETWEEN_DRAFTS=0 turns it off.
    dequantize_between_drafts: bool = field(
        default_factory=lambda: os.environ.get("LYNXKV_DEQUANT_BETWEEN_DRAFTS", "1") != "0")
    # Greedy only: at the first draft whose top-1 − top-2 logit margin on the anchor is below this, fork a second
    # chain from the runner-up token, drafted in the same forwards and verified when the main chain is rejected
    # exactly there (lynxkv.speculative.branch). 0: off.
    branch_margin: float = 0.0
    # The branch reads the draft cache's tokens before the fork in place, in one attention product with the main
    # chain's, instead of copying them (lynxkv.speculative.packed.forward_forked; models with plain attention).
    # LYNXKV_BRANCH_SHARED_PREFIX=0 turns it off.
    branch_shared_prefix: bool = field(
        default_factory=lambda: os.environ.get("LYNXKV_BRANCH_SHARED_PREFIX", "1") != "0")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_window < 0:
            raise InputError(f"max_window must be >= 0, got {self.max_window}")
        if self.verify_first < 0:
            raise InputError(f"verify_first must be >= 0, got {self.verify_first}")
        if not 0 <= self.min_window_steps < math.inf:
            raise InputError(f"min_window_steps must be a finite number >= 0, got {self.min_window_steps}")
        if not self.branch_margin >= 0:
            raise InputError(f"branch_margin must be >= 0, got {self.branch_margin}")
        if self.branch_margin > 0 and not self.sampling.greedy:
            raise InputError("branch_margin: greedy decoding only (not with temperature > 0)")
        # torch.Generator.manual_seed takes what fits 64 bits, signed or not: more fails at the run's start
        if self.seed is not None:
            try:
                seed = None if isinstance(self.seed, bool) else operator.index(self.seed)  # numpy ints too
            except TypeError:
                seed = None
            if seed is None or not -2**63 <= seed < 2**64:
                raise InputError(f"seed must be an integer that fits 64 bits (-2**63 to 2**64 - 1), got {self.seed!r}")
            object.__setattr__(self, "seed", seed)


@dataclass
class Event:
    """One step of a run, for a UI or a serving engine.

    ``draft``: provisional ``tokens`` (only with ``provisional=True``); ``commit``: final ``tokens`` (the first
    ``confirmed`` of them were the oldest provisional ones); ``retract``: the newest ``count`` provisional tokens
    are withdrawn; ``done``: the end, with ``stats``. ``verified`` is False only for anchor-only output.
    """

    kind: str
    time_s: float
    tokens: list[int] = field(default_factory=list)
    confirmed: int = 0
    count: int = 0
    verified: bool = True
    stats: RunStats | None = None


@dataclass
class RunResult:
    token_ids: list[int]
    stats: RunStats

    @property
    def verified(self) -> bool:
        return self.stats.verified


def clip_tokens(tokens: list[int], room: int, stops) -> list[int]:
    """What of ``tokens`` is committed: at most ``room`` of them, up to and including the first stop token."""
    tokens = tokens[:room]
    for i, tok in enumerate(tokens):
        if tok in stops:
            return tokens[: i + 1]
    return tokens


def is_finished(committed: list[int], max_new_tokens: int, stops) -> bool:
    """Whether a request that committed ``committed`` is done: ``max_new_tokens`` reached, or a stop token last."""
    return len(committed) >= max_new_tokens or (bool(committed) and committed[-1] in stops)


def check_load(load: CacheLoad, fingerprint: str) -> list[int]:
    """The load's prompt token ids, after refusing caches made by another model or without token ids."""
    ids = load.prompt_token_ids
    if not ids:
        raise InputError("the cache records no prompt token ids, so there is no prompt to continue")
    if load.model_fingerprint is None:
        raise InputError("the cache does not record which model made it (no model fingerprint)")
    if load.model_fingerprint != fingerprint:
        raise InputError(
            f"the cache was made by another model (fingerprint {load.model_fingerprint}, "
            f"this model is {fingerprint}); pass the model that produced it"
        )
    return [int(t) for t in ids]


def stream(
    model,
    load: CacheLoad,
    config: RunConfig = RunConfig(),
    *,
    new_token_ids: list[int] | None = None,
    provisional: bool = False,
    tracker: AcceptanceTracker | None = None,
    fingerprint: str | None = None,
    started_at: float | None = None,
) -> Iterator[Event]:
    """Run Lynx decoding over ``load`` and yield :class:`Event` s as tokens are drafted, committed, retracted.

    ``new_token_ids`` continue the cached prompt with new text (a question after a cached document; see
    :func:`lynxkv.hf.continuation_ids`): they are prefilled on the anchor cache while the residual streams, and
    verified together with the drafts. ``fingerprint`` is the model's (computed when not given). ``started_at``
    is the ``time.perf_counter()`` at which the load was opened (default: now), the zero of every time in the
    stats. The last event is ``done``. The cache's identity is checked once its header has arrived with the
    anchor, before any token is drafted.
    """
    t0 = time.perf_counter() if started_at is None else started_at
    now = lambda: time.perf_counter() - t0  # noqa: E731
    fingerprint = fingerprint or model_fingerprint(model)
    config_obj = model.config
    new = [int(t) for t in (new_token_ids or ())]
    stats = RunStats()
    params = config.sampling
    generator = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    committed: list[int] = []
    stops = set(config.stop_token_ids)

    residual = load.residual

    def on_residual(fut: concurrent.futures.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            t = now()  # a layered verify may have had the last layer in (and noted it) before the future's callback
            stats.residual_ready_s = t if stats.residual_ready_s is None else min(t, stats.residual_ready_s)

    residual.add_done_callback(on_residual)

    def commit(tokens: list[int], confirmed: int, verified: bool = True) -> Event | None:
        tokens = clip_tokens(tokens, config.max_new_tokens - len(committed), stops)
        if not tokens:
            return None
        t = now()
        committed.extend(tokens)
        stats.commit_times_s.extend([t] * len(tokens))
        if stats.first_commit_s is None:
            stats.first_commit_s = t
        return Event("commit", t, tokens=tokens, confirmed=min(confirmed, len(tokens)), verified=verified)

    def finished() -> bool:
        return is_finished(committed, config.max_new_tokens, stops)

    # ---- anchor -------------------------------------------------------------------------------------------
    remaining = None if config.anchor_timeout is None else max(0.0, config.anchor_timeout)
    try:
        anchor_kv = load.wait_anchor(remaining)
    except TimeoutError:
        raise LynxError(f"the anchor did not arrive within {config.anchor_timeout:g} s") from None
    stats.anchor_ready_s = now()
    prompt = check_load(load, fingerprint)
    stats.cached_prompt_tokens = len(prompt)
    stats.prompt_tokens = len(prompt) + len(new)
    check_kv(anchor_kv, config_obj, len(prompt), "anchor")
    keep, feed = first_step(prompt, new)  # the stored tokens the caches keep, what their first forward consumes
    # The load hands its KV out as the front of buffers with room (open_progressive(room=N)): the draft cache grows
    # into the anchor's and the verify cache into the full code's, so neither first step copies the whole cache
    adopt = bool(getattr(load, "grow_in_place", False))

    # ---- draft while the residual streams -------------------------------------------------------------------
    cap = min(config.max_window, config.max_new_tokens) if config.speculate else 0
    stats.window_cap = cap
    if cap and tracker is not None:
        stats.drafting_disabled = tracker.skip_reason()
        if stats.drafting_disabled:
            cap = 0
    if cap and config.min_window_steps > 0:
        stats.drafting_disabled = wait_reason(model, load.residual_eta(), len(prompt) + len(new),
                                              config.min_window_steps, config.step_estimate_s)
        if stats.drafting_disabled:
            cap = 0
    drafts: list[int] = []
    draft_probs: list[torch.Tensor] = []
    draft_cache = None
    pending = feed  # the tokens the next forward on the draft cache consumes
    step_times: list[float] = []
    # The layered verify (lynxkv.speculative.layered) needs a load that hands out the full code layer by layer
    wants_layered = config.verify_chunk <= 0 and (
        config.layered_verify if config.layered_verify is not None else config.verify_first <= 0)
    layers = None if wants_layered and hasattr(load, "layer_in") else False
    layered = False  # drafting stopped to verify layer by layer as the rest of the residual lands
    brancher = (Brancher(config.branch_margin, stops, shared=config.branch_shared_prefix and shares_prefix(model))
                if config.branch_margin > 0 and cap else None)
    step_fn = forward_tokens if brancher is None else brancher.forward  # with a branch: its next token too
    # A progressive load says when every residual byte is in and dequantizes landed layers on request: the runner
    # does that between draft steps, and stops drafting (or ends the step under way) once the bytes are all in, so
    # little of the full code is left to build after the last byte (lynxkv.stream.progressive)
    bytes_in = getattr(load, "residual_in", None) if config.dequantize_between_drafts else None
    take_landed = getattr(load, "dequantize_landed", None) if config.dequantize_between_drafts else None
    interrupt = DraftInterrupt(model, residual, also=bytes_in) if config.interrupt_drafts and cap else None
    # While it drafts, the runner alone dequantizes the landed layers, between its steps: the load's early worker
    # running during a step would take a core from the forward's threads (docs/speculative.md, "Drafting alone")
    hold = getattr(load, "hold_early", None) if take_landed is not None and cap else None
    if hold is not None:
        hold(True)
    with interrupt.installed() if interrupt is not None else contextlib.nullcontext():
        while len(drafts) < cap and not residual.done() and not (bytes_in is not None and bytes_in()):
            check_layered = len(step_times) >= 2 and layers  # the first step, on a fresh cache, is not a typical one
            check_guard = bool(step_times) and config.eta_guard > 0
            eta = load.residual_eta() if check_layered or check_guard else None  # read once for both checks
            if check_layered:
                step = statistics.median(step_times[1:])
                rows = len(feed) + len(drafts)
                if eta is not None and eta < verify_estimate(model, rows, step) * (1 - 1 / len(layers)):
                    layered = True
                    break
            if check_guard:
                step = sum(step_times) / len(step_times)
                if eta is not None and eta < config.eta_guard * step:
                    stats.waited_on_eta = True
                    concurrent.futures.wait([residual], timeout=eta + 2 * step + 0.01)  # slack for a late wake-up
                    if residual.done():
                        break
            if draft_cache is None:
                draft_cache = start_cache(model, anchor_kv, keep, adopt=adopt)
                if layers is None:
                    layers = decoder_layers(model, draft_cache) or False
            ts = time.perf_counter()
            try:
                out = step_fn(model, draft_cache, pending) if interrupt is None else \
                    interrupt.run(step_fn, model, draft_cache, pending)
            except Superseded:  # the full code is in: verify now, without this step's token
                break
            logits = out[-1]  # [V]
            if brancher is not None:  # fork here if the anchor is unsure (before this step's token is fed)
                brancher.consider(logits, draft_cache, len(drafts))
            token, probs = choose(logits, params, generator)
            te = time.perf_counter()
            stats.draft_steps.append([ts - t0, te - t0])
            if brancher is not None and brancher.packed_last:
                stats.branch_draft_steps.append([ts - t0, te - t0])
            if len(pending) == 1:  # a draft step; the first forward over new prompt tokens is a prefill
                step_times.append(te - ts)
            drafts.append(token)
            if probs is not None:
                draft_probs.append(probs)
            pending = [token]
            if take_landed is not None:
                stats.layers_dequantized_between_drafts += take_landed()
            if stats.first_draft_s is None:
                stats.first_draft_s = now()
            if stats.window_planned is None and step_times:
                eta = load.residual_eta()
                if eta is not None:
                    stats.window_planned = min(cap, len(drafts) + math.ceil(eta / max(step_times[0], 1e-9)))
            if provisional:
                yield Event("draft", now(), tokens=[token])
            if token in stops:
                break
    stats.drafts_abandoned = interrupt.abandoned if interrupt is not None else 0
    stats.drafted = len(drafts)
    stats.draft_token_ids = list(drafts)
    if brancher is not None:
        brancher.record(stats)
    if step_times:
        later = step_times
        if len(feed) == 1:  # the first draft forward grew the fresh anchor cache (new prompt tokens: the prefill did)
            stats.first_draft_step_s = step_times[0]
            later = step_times[1:] or step_times
        stats.draft_step_s = statistics.median(later)

    # Drafting ended before the residual landed (the window cap, a stop token): the verify still runs layer by layer
    # as the rest lands, instead of after the last layer's bytes and dequantization. With nothing drafted the first
    # forward waits for the whole full code: run layer by layer it came no sooner (docs/speculative.md, 1 Gbit/s).
    if drafts and not layered and layers and not residual.done():
        layered = True
    if hold is not None and not layered:  # waiting for the whole residual: the early worker takes the idle cores
        hold(False)  # (a layered verify takes each layer itself as it reaches it)

    # ---- wait for the residual, or verify layer by layer as it lands -----------------------------------------
    full_kv: KVPairs | None = None
    error: str | None = None
    deadline = None if config.residual_timeout is None else t0 + config.residual_timeout
    timed_out = ("the residual did not arrive in time" if config.residual_timeout is None
                 else f"the residual did not arrive within {config.residual_timeout:g} s")
    cache = lv = None
    if layered:
        cache = start_cache(model, anchor_kv, keep)  # the anchor's shapes; each layer is replaced before its use
        lv = LayeredVerify(load, cache, layers, keep, model.dtype, model.device, deadline, adopt=adopt)
        stats.verify_layered = True
    else:
        try:
            full_kv = residual.result(timeout=None if deadline is None else max(0.0, deadline - time.perf_counter()))
        except concurrent.futures.TimeoutError:
            error = timed_out
        except Exception as exc:  # the transport's failure, whatever its type
            error = f"the residual failed: {exc}"
        if full_kv is not None:
            stats.residual_seen_s = now()
            check_kv(full_kv, config_obj, len(prompt), "full")
            cache = start_cache(model, full_kv, keep, adopt=adopt)

    # ---- verify: one forward over [fed prompt tokens, d0 .. d(k-1)] ----------------------------------------------
    early = 0  # drafts committed by a verify pass before the last one
    if cache is not None:
        stats.verify_start_s = now()
        tv = time.perf_counter()
        # the layered verify's first pass fills every layer as it reaches it; a later pass reads the grown layers
        sizes = [len(drafts)] if lv is not None else pass_sizes(len(drafts), config.verify_chunk, config.verify_first)
        fork = brancher.pending() if brancher is not None else None
        if fork is not None:  # a pass ends at the fork's draft
            sizes = cut_at(sizes, fork.at + 1)
        try:
            with lv.installed() if lv is not None else contextlib.nullcontext():
                passes_run = verify_drafts(model, cache, feed, drafts, draft_probs, params, generator, sizes)
                while True:  # the drafts a pass accepted are committed before the next pass runs
                    try:
                        accepted_so_far = next(passes_run)
                    except StopIteration as end:
                        accepted, next_token, fed, passes = end.value
                        break
                    ev = commit(drafts[early:accepted_so_far], confirmed=accepted_so_far - early)
                    early = accepted_so_far
                    if ev is not None:
                        yield ev
        except TimeoutError:
            if lv is None:
                raise
            error = timed_out
        except LynxError as exc:  # a layer of the residual failed to arrive or to decode
            if lv is None:
                raise
            error = f"the residual failed: {exc}"
        stats.verify_s = time.perf_counter() - tv
        stats.verify_end_s = now()
        if lv is not None and error is None:
            stats.residual_seen_s = lv.last_layer_s - t0
            if stats.residual_ready_s is None or stats.residual_seen_s < stats.residual_ready_s:
                stats.residual_ready_s = stats.residual_seen_s  # the whole full code was in: the last layer's
            stats.verify_waited_s = lv.waited_s
            if step_times:
                remember_verify(model, len(feed) + len(drafts), stats.verify_s - lv.waited_s,
                                statistics.median(step_times))

    if error is not None:
        if not config.allow_anchor_only:
            raise ResidualUnavailable(f"{error} (allow anchor-only output to continue unverified on the anchor)")
        stats.verified, stats.residual_error = False, error
        brancher = None  # the branch is never verified
        if draft_cache is None:
            draft_cache = start_cache(model, anchor_kv, keep, adopt=adopt)
        ev = commit(drafts, confirmed=len(drafts), verified=False)
        if ev:
            yield ev
        yield from _decode(model, draft_cache, pending, params, generator, commit, finished, stats, t0,
                           verified=False)
        stats.load = asdict(load.timeline)
        yield Event("done", now(), stats=stats, verified=False)
        return

    stats.verify_passes, stats.verify_pass_sizes = len(passes), passes
    stats.accepted = accepted
    if tracker is not None:
        tracker.record(len(drafts), accepted)
    drop_last(cache, fed - accepted)  # cache: prompt + new tokens + d0 .. d(accepted-1)
    # The anchor cache (the anchor KV grown by every draft) and the drafts' distributions are done with: let them go
    # before decoding on, rather than hold a second cache of the prompt's size through every later step.
    del draft_cache, anchor_kv
    draft_probs.clear()

    ev = commit(drafts[early:accepted], confirmed=accepted - early)
    if ev is not None:
        yield ev
    if provisional and len(drafts) > accepted:
        yield Event("retract", now(), count=len(drafts) - accepted)
    if not finished():
        ev = commit([next_token], confirmed=0)
        if ev is not None:
            yield ev
    side = brancher.to_verify(accepted, next_token) if brancher is not None else None
    brancher = None
    if side is not None and not finished():  # the main chain lost exactly at the fork, to the branch's root
        tb = time.perf_counter()
        stats.branch_accepted, next_token = verify_branch(model, cache, side)
        stats.branch_verify_s = time.perf_counter() - tb
        side = None  # the branch's cache
        for tokens in (stats.branch_token_ids[1 : 1 + stats.branch_accepted], [next_token]):
            ev = commit(tokens, confirmed=0) if not finished() else None
            if ev is not None:
                yield ev

    # ---- continue on the full cache ---------------------------------------------------------------------------
    yield from _decode(model, cache, [next_token], params, generator, commit, finished, stats, t0, verified=True)
    stats.load = asdict(load.timeline)
    yield Event("done", now(), stats=stats)


def _decode(model, cache, pending: list[int], params, generator, commit, finished, stats: RunStats,
            t0: float, *, verified: bool):
    """Plain decoding: feed ``pending``, choose the next token, commit it, until ``finished()``."""
    times: list[float] = []
    while not finished():
        length = int(cache.get_seq_length())
        ts = time.perf_counter()
        logits = forward_tokens(model, cache, pending)[-1]  # [V]
        token, _ = choose(logits, params, generator)
        te = time.perf_counter()
        if len(pending) == 1:
            times.append(te - ts)
            stats.decode_steps.append([ts - t0, te - t0, length])
        ev = commit([token], confirmed=0, verified=verified)
        if ev is None:
            break
        yield ev
        pending = [token]
    if times:
        stats.decode_step_s = statistics.median(times)
        remember_step(model, int(cache.get_seq_length()) - len(times) // 2, stats.decode_step_s)


def run(model, load: CacheLoad, config: RunConfig = RunConfig(), **kwargs) -> RunResult:
    """Run to the end and return the committed token ids and the stats (see :func:`stream`)."""
    tokens: list[int] = []
    stats = None
    for ev in stream(model, load, config, **kwargs):
        if ev.kind == "commit":
            tokens.extend(ev.tokens)
        elif ev.kind == "done":
            stats = ev.stats
    assert stats is not None  # stream always ends with "done"
    return RunResult(tokens, stats)
