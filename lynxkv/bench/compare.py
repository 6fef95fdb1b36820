"""Monolithic baselines for ``lynxkv run --compare``, under the same emulated link as the Lynx run.

Each baseline moves its whole cache over the link and only then decodes plainly (no speculation):

- ``monolithic-bf16``: the cache as the model holds it, 2 bytes per element; decoded on the full-code KV rounded
  to bf16 (the file stores codes, not the original BF16 values; the decode cost is the same);
- ``monolithic-full``: the full lynx code (anchor + residual segments, as stored), decoded on the full KV;
- ``anchor-only``: the anchor segment alone, decoded on the anchor KV: the lossy 4-bit floor, flagged unverified.

Transfer times are computed as ``latency + bytes / bandwidth`` and then actually waited (a :class:`PreparedLoad`
releases the KV after that delay), so decoding starts in wall-clock time where a real transfer would end it. The
link is shared by nothing else during a baseline; the Lynx run sends its residual right behind the anchor on
one link, so its residual lands at the same time as the monolithic full code would.

On a shared machine one slow decode flips a verdict, so :func:`compare_run` can repeat every method, Lynx
included, interleaved round by round, and judge on medians (``lynxkv run --compare --repeats N``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable

from lynxkv.errors import LynxError
from lynxkv.cache.kv import KVPairs
from lynxkv.cache.loading import CacheLoad, PreparedLoad
from lynxkv.bench.simulated import bf16_bytes, round_bf16, transfer_time
from lynxkv.speculative import RunConfig, RunResult, Timing, run

#: Every method ``--compare`` runs, in the order of its first round; later rounds rotate it by one each.
METHODS = ("lynx", "monolithic-bf16", "monolithic-full", "anchor-only")

Runs = dict[str, list[tuple[float, RunResult]]]  # method -> [(data-ready seconds, result)], one per round


def baseline_cases(anchor_kv: KVPairs, full_kv: KVPairs, anchor_bytes: int,
                   residual_bytes: int) -> dict[str, tuple[int, KVPairs, bool]]:
    """``{name: (bytes sent, KV decoded on, lossy)}`` for every monolithic baseline."""
    return {
        "monolithic-bf16": (bf16_bytes(full_kv), round_bf16(full_kv), False),
        "monolithic-full": (anchor_bytes + residual_bytes, full_kv, False),
        "anchor-only": (anchor_bytes, anchor_kv, True),
    }


def run_baseline(model, case: tuple[int, KVPairs, bool], prompt_ids: list[int], fingerprint: str, *,
                 bandwidth: float | None, latency: float | None, config: RunConfig,
                 new_token_ids: list[int] | None = None, grow_in_place: bool = False) -> tuple[float, RunResult]:
    """One baseline: wait for its whole transfer, then decode plainly; ``(transfer seconds, result)``.
    ``grow_in_place``: its cache may grow into the room of the KV's buffers, as the Lynx run's did."""
    nbytes, kv, lossy = case
    delay = transfer_time(nbytes, bandwidth, latency)
    cfg = replace(config, speculate=False, allow_anchor_only=lossy, residual_timeout=None)
    started = time.perf_counter()
    load = PreparedLoad(
        kv,
        None if lossy else kv,
        anchor_delay=delay,
        residual_delay=delay,
        residual_error=LynxError("anchor-only baseline: no residual is sent") if lossy else None,
        prompt_token_ids=prompt_ids,
        model_fingerprint=fingerprint,
        anchor_bytes=nbytes,
        grow_in_place=grow_in_place,
    )
    try:
        return delay, run(model, load, cfg, new_token_ids=new_token_ids, fingerprint=fingerprint, started_at=started)
    finally:
        load.close()


def run_lynx(model, open_load: Callable[[], CacheLoad], config: RunConfig, fingerprint: str,
             new_token_ids: list[int] | None = None, timing: Timing | None = None) -> tuple[float, RunResult]:
    """One more Lynx run over a fresh load from ``open_load``; ``(residual-ready seconds, result)``."""
    started = time.perf_counter()
    load = open_load()
    try:
        result = run(model, load, config, new_token_ids=new_token_ids, fingerprint=fingerprint, started_at=started,
                     timing=timing)
    finally:
        load.close()
    if not result.verified:
        raise LynxError("--compare needs the residual (a repeated run fell back to anchor-only output)")
    return result.stats.residual_ready_s, result


def _median(values: list) -> float | None:
    """The median, or None when any value is missing (a run that committed fewer tokens)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def tt_rows(runs: Runs, ns=(1, 32, 64)) -> list[dict]:
    """One row per method: the medians over its runs of the data-ready time and TT-n for each n, whether every
    run's tokens equal the first Lynx run's, and each run's own figures (``runs``)."""
    reference = runs["lynx"][0][1].token_ids
    rows = []
    for method, results in runs.items():
        per_run = [
            {
                "ready_s": ready,
                **{f"tt{n}_s": res.stats.tt(n) for n in ns},
                "drafted": res.stats.drafted,
                "accepted": res.stats.accepted,
                "same_tokens_as_lynx": res.token_ids == reference,
            }
            for ready, res in results
        ]
        rows.append({
            "method": method,
            "ready_s": _median([r["ready_s"] for r in per_run]),
            **{f"tt{n}_s": _median([r[f"tt{n}_s"] for r in per_run]) for n in ns},
            "same_tokens_as_lynx": all(r["same_tokens_as_lynx"] for r in per_run),
            "verified": all(res.verified for _, res in results),
            "runs": per_run,
        })  # fmt: skip
    return rows


def verdict(tt: float | None, full_tt: float | None, anchor_tt: float | None, t_res: float | None,
            tpot: float | None, n: int = 64) -> dict:
    """What TT-n measured against the baselines: the gain over the monolithic full code as a fraction of
    Δ = min(t_res, n TPOT) (the most drafting can save), and TT-n as a ratio to the anchor-only run's; with the
    numbers they were computed from (None: not measurable)."""
    delta = min(t_res, n * tpot) if t_res is not None and tpot is not None else None
    ok = None not in (tt, full_tt, anchor_tt, delta)
    return {
        "n": n,
        "tt_lynx_s": tt,
        "tt_full_s": full_tt,
        "tt_anchor_only_s": anchor_tt,
        "t_res_s": t_res,
        "tpot_s": tpot,
        "delta_theoretical_s": delta,
        "gain_measured_s": (full_tt - tt) if ok else None,
        "gain_over_delta": (full_tt - tt) / delta if ok and delta > 0 else None,
        "ratio_to_anchor_only": tt / anchor_tt if ok and anchor_tt > 0 else None,
    }


def judge(runs: Runs, n: int = 64) -> dict:
    """:func:`verdict` on medians over the runs (TT-n of each method, t_res of the Lynx runs, TPOT of the
    monolithic full-code runs), with ``repeats`` and each round's own verdict (``rounds``)."""
    lynx = [res.stats for _, res in runs["lynx"]]
    full = [res.stats for _, res in runs["monolithic-full"]]
    anchor = [res.stats for _, res in runs["anchor-only"]]
    out = verdict(
        _median([s.tt(n) for s in lynx]), _median([s.tt(n) for s in full]), _median([s.tt(n) for s in anchor]),
        _median([s.residual_after_anchor_s for s in lynx]), _median([s.decode_step_s for s in full]), n,
    )  # fmt: skip
    out["repeats"] = len(lynx)
    out["rounds"] = [verdict(l.tt(n), f.tt(n), a.tt(n), l.residual_after_anchor_s, f.decode_step_s, n)
                     for l, f, a in zip(lynx, full, anchor)]
    return out


def compare_run(model, load: CacheLoad, lynx: RunResult, config: RunConfig, fingerprint: str, *,
                bandwidth: float | None, latency: float | None = None, new_token_ids: list[int] | None = None,
                repeats: int = 1, open_load: Callable[[], CacheLoad] | None = None, n: int = 64,
                timing: Timing | None = None) -> dict:
    """What ``lynxkv run --compare`` reports: the finished Lynx run ``lynx`` over ``load`` beside the monolithic
    baselines, each run on the KV that ``load`` delivered, under the same link (``bandwidth`` None: the rate the
    load actually achieved). Rows give TT1, TT32 and TT-``n``; the verdict is on TT-``n``.

    With ``repeats`` > 1 every method runs that many times, interleaved: round r runs each method once, in
    :data:`METHODS` order rotated by r (``lynx`` is the caller's run in round 0; later Lynx runs go over a
    fresh load from ``open_load``), so a slow stretch of a shared machine falls on different methods. Rows and
    the verdict are medians over the rounds; each round's figures stay in the report."""
    if repeats < 1:
        raise LynxError(f"--repeats: expected >= 1, got {repeats}")
    if repeats > 1 and open_load is None:
        raise LynxError("repeating the Lynx run needs a way to open a fresh load (open_load)")
    if not lynx.verified:
        raise LynxError("--compare needs the residual (the run fell back to anchor-only output)")
    tl = load.timeline
    anchor_kv, full_kv = load.wait_anchor(), load.residual.result()
    if bandwidth is None:  # no emulated link: use the rate this load actually achieved
        total = tl.anchor_bytes + tl.residual_bytes
        bandwidth = total / tl.residual_ready_s if tl.residual_ready_s else None
    cases = baseline_cases(anchor_kv, full_kv, tl.anchor_bytes, tl.residual_bytes)
    # Where the Lynx load handed out its KV with room, the baselines' caches grow into it too (one run at a time;
    # every run drops or rewrites the rows from the cached prompt's last token on), so that no method pays a first
    # step's copy of the whole cache that another does not
    grow = load.grow_in_place
    prompt_ids = list(load.prompt_token_ids)
    runs: Runs = {m: [] for m in METHODS}
    runs["lynx"].append((lynx.stats.residual_ready_s, lynx))
    for r in range(repeats):
        for method in METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]:
            if method == "lynx":
                if r:
                    runs["lynx"].append(run_lynx(model, open_load, config, fingerprint, new_token_ids, timing))
                continue
            runs[method].append(run_baseline(model, cases[method], prompt_ids, fingerprint, bandwidth=bandwidth,
                                             latency=latency, config=config, new_token_ids=new_token_ids,
                                             grow_in_place=grow))
    return {
        "link": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency},
        "transfer": "monolithic: computed as latency + bytes / bandwidth, then actually waited before decoding",
        "repeats": repeats,
        "bytes": {"anchor": tl.anchor_bytes, "residual": tl.residual_bytes, "monolithic-bf16": bf16_bytes(full_kv)},
        "rows": tt_rows(runs, ns=sorted({1, 32, n})),
        "judge": judge(runs, n),
        "stats": {method: [res.stats.to_dict() for _, res in results] for method, results in runs.items()},
    }
