"""The decode engine: every request a state machine (:mod:`lynxkv.speculative.request`), every step ONE forward.

Each step moves every request through the phases that wait on its load (arrival, anchor, residual), then runs the
forwards of the requests that are ready (drafting, verifying, decoding) packed in one (lynxkv.speculative.packed),
and hands each its rows. ``lynxkv run a.lynx`` is a batch of one (:func:`stream`, :func:`run`); ``lynxkv run a.lynx
b.lynx ..`` and :func:`run_batch` are the same engine with several.

The committed tokens are those of plain decoding on each request's full code (greedy: token for token; sampling: in
distribution), with "plain decoding" defined by :func:`~lynxkv.speculative.plain.decode_plain` and the forward shapes
the stats record (``first_forward=stats.draft_token_ids``, ``branch=(stats.branch_at, stats.branch_token_ids)``).
A request whose residual fails or is late ends with its own error (or, with ``allow_anchor_only``, goes on flagged
unverified on its anchor); the others are not affected. Times in each request's stats are seconds since its own
arrival (when its load was opened, or ``started_at`` for a run alone).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from lynxkv.cache.loading import CacheLoad
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative.config import BatchRequest, Event, RequestResult, RunConfig, RunResult
from lynxkv.speculative.model_ops import settle
from lynxkv.speculative.packed import forward_packed
from lynxkv.speculative.request import FORWARD_PHASES, Request
from lynxkv.speculative.timing import Timing


@dataclass
class BatchResult:
    requests: list[RequestResult]
    steps: list[list[float]]  # [start, end, requests in the step, tokens in the step] per forward
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


class Engine:
    """Steps a set of requests to their end (see the module docstring)."""

    def __init__(self, model, requests: list[Request], *, max_batch: int | None = None):
        self.model, self.requests, self.max_batch = model, requests, max_batch
        self.steps: list[list[float]] = []
        self.t0 = time.perf_counter()

    def live(self) -> list[Request]:
        return [r for r in self.requests if r.phase != "done"]

    def step(self) -> bool:
        """Advance every request, then run one forward (or wait when nothing is ready); False once all are done."""
        opened = sum(1 for r in self.requests if r.phase not in ("arrive", "done"))
        for r in self.requests:
            if r.phase == "arrive" and self.max_batch is not None and opened >= self.max_batch:
                continue  # it waits to be admitted: nothing of it is loaded before there is room
            if r.phase != "done":
                arriving = r.phase == "arrive"
                r.advance(self.t0)
                opened += arriving and r.phase not in ("arrive", "done")
                if r.phase == "done":
                    r.leave()
        live = self.live()
        if not live:
            return False
        ready = [r for r in live if r.phase in FORWARD_PHASES and not r.holds()]
        if self.max_batch is not None:
            ready = ready[: self.max_batch]
        if not ready:
            _idle(live, self.t0)
            return True
        self._forward(ready)
        return True

    def _forward(self, ready: list[Request]) -> None:
        start = time.perf_counter()
        with contextlib.ExitStack() as layered:  # the layered verifies' hooks fill their layers as they land
            for r in ready:
                if r.lv is not None:
                    layered.enter_context(r.lv.installed())
            if len(ready) == 1 and ready[0].alone:
                seqs = [[(ready[0].cache, ready[0].pending)]]
                rows = [ready[0].forward_alone()]
            else:
                seqs = [r.sequences() for r in ready]
                rows = forward_packed(self.model, [c for s in seqs for c, _ in s], [t for s in seqs for _, t in s])
            settle(self.model)  # the step's time is its kernels' (on a GPU the host runs ahead of them)
        end = time.perf_counter()
        if rows[0] is None:  # a draft forward ended part-way: the residual is in, nothing to take
            return
        self.steps.append([start - self.t0, end - self.t0, len(ready), sum(len(t) for s in seqs for _, t in s)])
        waited = sum(r.lv.waited_s for r in ready if r.lv is not None)  # the whole step waited on these
        at = 0
        for r, s in zip(ready, seqs):
            x, side = rows[at], rows[at + 1] if len(s) > 1 else None
            at += len(s)
            r.take_rows(x, start, end, side, waited)
            if r.phase == "done":
                r.leave()

    def close(self) -> None:
        for r in self.requests:
            r.leave()


def _idle(live: list[Request], t0: float) -> None:
    """Nothing to compute: sleep until a residual lands, an anchor may be in, or the next request arrives."""
    now = time.perf_counter()
    arrivals = [t0 + r.spec.arrival_s - now for r in live if r.phase == "arrive"]
    timeout = min([0.01] + [max(0.0, a) for a in arrivals])
    futures = [r.load.residual for r in live if r.phase in ("wait", "draft") and r.load is not None]
    anchors = [r for r in live if r.phase == "anchor" and r.load is not None]
    if anchors and not futures:
        with contextlib.suppress(Exception):  # the request's own advance() sees what went wrong
            anchors[0].load.wait_anchor(timeout)
    elif futures:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
    else:
        time.sleep(timeout)


def _requests(model, specs: list[BatchRequest], fingerprint: str | None, timing: Timing | None, *,
              provisional: bool = False) -> list[Request]:
    fingerprint = fingerprint or model_fingerprint(model)
    timing = timing if timing is not None else Timing()
    alone = len(specs) == 1
    return [Request(spec, i, model, fingerprint, timing, alone=alone, provisional=provisional)
            for i, spec in enumerate(specs)]


def run_batch(model, requests: list[BatchRequest], *, fingerprint: str | None = None, max_batch: int | None = None,
              on_step: Callable[[list[RequestResult]], None] | None = None, close_loads: bool = True,
              timing: Timing | None = None) -> BatchResult:
    """Decode every request, all of them together; results in the order given.

    ``max_batch`` caps how many requests are open at once (loading, drafting, verifying or decoding): the next to
    arrive is admitted, and its load opened, only when one of them has left, so memory holds at most ``max_batch``
    requests' caches; its times still count from its arrival. ``on_step(partial results)`` is called after every
    forward. Each load is closed when its request is done with it unless ``close_loads`` is False. ``timing``: this
    machine's step estimates (:class:`~lynxkv.speculative.timing.Timing`; a fresh one when None).
    """
    reqs = _requests(model, requests, fingerprint, timing)
    for r in reqs:
        r.close_load = close_loads
    engine = Engine(model, reqs, max_batch=max_batch)
    try:
        while True:
            forwards = len(engine.steps)
            if not engine.step():
                break
            if on_step is not None and len(engine.steps) > forwards:  # after every forward
                on_step([r.result() for r in reqs])
    finally:
        engine.close()
    return BatchResult([r.result() for r in reqs], engine.steps, time.perf_counter() - engine.t0)


def stream(model, load: CacheLoad, config: RunConfig = RunConfig(), *, new_token_ids: list[int] | None = None,
           provisional: bool = False, fingerprint: str | None = None, started_at: float | None = None,
           timing: Timing | None = None) -> Iterator[Event]:
    """Decode one request over ``load`` and yield :class:`Event` s as tokens are drafted, committed, retracted.

    ``new_token_ids`` continue the cached prompt with new text (a question after a cached document): they are
    prefilled on the anchor cache while the residual streams, and verified with the drafts. ``started_at`` is the
    ``time.perf_counter()`` at which the load was opened (default: now), the zero of every time in the stats. The
    last event is ``done``. A failure of the request (a cache of another model, a residual that fails without
    ``allow_anchor_only``) is raised.
    """
    spec = BatchRequest(load, config, new_token_ids)
    (request,) = _requests(model, [spec], fingerprint, timing, provisional=provisional)
    request.close_load = False  # the caller opened it and closes it
    engine = Engine(model, [request])
    if started_at is not None:
        engine.t0 = started_at
    try:
        while engine.step():
            yield from _drain(request)
        yield from _drain(request)
    finally:
        engine.close()
    if request.exc is not None:
        raise request.exc
    stats = request.result().stats
    stats.load = load.timeline.as_dict()
    yield Event("done", request.now(), stats=stats, verified=request.verified)


def _drain(request: Request) -> Iterator[Event]:
    events, request.events = request.events, []
    yield from events


def run(model, load: CacheLoad, config: RunConfig = RunConfig(), **kwargs) -> RunResult:
    """Run one request to the end; the committed token ids and the stats (see :func:`stream`)."""
    tokens: list[int] = []
    stats = None
    for ev in stream(model, load, config, **kwargs):
        if ev.kind == "commit":
            tokens.extend(ev.tokens)
        elif ev.kind == "done":
            stats = ev.stats
    return RunResult(tokens, stats)
