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
"""

from __future__ import annotations

import time
from dataclasses import replace

from lynxkv.errors import LynxError
from lynxkv.kv import KVPairs
from lynxkv.loading import PreparedLoad
from lynxkv.speculative.simulated import bf16_bytes, round_bf16, transfer_time
from lynxkv.speculative.runner import RunConfig, RunResult, run


def run_baselines(
    model,
    prompt_ids: list[int],
    fingerprint: str,
    anchor_kv: KVPairs,
    full_kv: KVPairs,
    *,
    anchor_bytes: int,
    residual_bytes: int,
    bandwidth: float | None,
    latency: float | None,
    config: RunConfig,
    new_token_ids: list[int] | None = None,
) -> dict[str, tuple[float, RunResult]]:
    """``{name: (transfer seconds, result)}`` for every baseline, run one after the other."""
    plain = replace(config, speculate=False, allow_anchor_only=False, residual_timeout=None)
    cases = {
        "monolithic-bf16": (bf16_bytes(full_kv), lambda: round_bf16(full_kv), False),
        "monolithic-full": (anchor_bytes + residual_bytes, lambda: full_kv, False),
        "anchor-only": (anchor_bytes, lambda: anchor_kv, True),
    }
    out: dict[str, tuple[float, RunResult]] = {}
    for name, (nbytes, kv_fn, lossy) in cases.items():
        kv = kv_fn()
        delay = transfer_time(nbytes, bandwidth, latency)
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
        )
        try:
            cfg = replace(plain, allow_anchor_only=lossy)
            out[name] = (delay, run(model, load, cfg, new_token_ids=new_token_ids, fingerprint=fingerprint,
                                    started_at=started))
        finally:
            load.close()
    return out


def tt_rows(lynx: RunResult, baselines: dict[str, tuple[float, RunResult]], ns=(1, 32, 64)) -> list[dict]:
    """One row per method: load time, TT-n for each n, and whether its tokens equal the Lynx run's."""
    rows = [
        {
            "method": "lynx",
            "ready_s": lynx.stats.residual_ready_s,
            **{f"tt{n}_s": lynx.stats.tt(n) for n in ns},
            "same_tokens_as_lynx": True,
            "verified": lynx.verified,
        }
    ]
    for name, (delay, res) in baselines.items():
        rows.append(
            {
                "method": name,
                "ready_s": delay,
                **{f"tt{n}_s": res.stats.tt(n) for n in ns},
                "same_tokens_as_lynx": res.token_ids == lynx.token_ids,
                "verified": res.verified,
            }
        )
    return rows


def judge(lynx: RunResult, baselines: dict[str, tuple[float, RunResult]], n: int = 64) -> dict:
    """The two targets of the design: TT-n(lynx) <= TT-n(full) - 0.6 min(t_res, n TPOT), and
    TT-n(lynx) <= 1.15 TT-n(anchor-only); with the numbers they were computed from."""
    tt = lynx.stats.tt(n)
    full = baselines["monolithic-full"][1].stats
    anchor = baselines["anchor-only"][1].stats
    tpot = full.decode_step_s
    t_res = lynx.stats.residual_after_anchor_s
    delta = min(t_res, n * tpot) if t_res is not None and tpot is not None else None
    full_tt, anchor_tt = full.tt(n), anchor.tt(n)
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
        "beats_full_by_0.6_delta": (tt <= full_tt - 0.6 * delta) if ok else None,
        "within_1.15_of_anchor_only": (tt <= 1.15 * anchor_tt) if ok else None,
    }


def compare_run(model, load, lynx: RunResult, config: RunConfig, fingerprint: str, *,
                bandwidth: float | None, latency: float | None, new_token_ids: list[int] | None = None) -> dict:
    """What ``lynxkv run --compare`` reports: the finished Lynx run ``lynx`` over ``load`` beside the monolithic
    baselines, each run on the KV that ``load`` delivered, under the same link (``bandwidth`` None: the rate the
    load actually achieved)."""
    if not lynx.verified:
        raise LynxError("--compare needs the residual (the run fell back to anchor-only output)")
    tl = load.timeline
    anchor_kv, full_kv = load.wait_anchor(), load.residual.result()
    if bandwidth is None:  # no emulated link: use the rate this load actually achieved
        total = tl.anchor_bytes + tl.residual_bytes
        bandwidth = total / tl.residual_ready_s if tl.residual_ready_s else None
    baselines = run_baselines(
        model, list(load.prompt_token_ids), fingerprint, anchor_kv, full_kv, anchor_bytes=tl.anchor_bytes,
        residual_bytes=tl.residual_bytes, bandwidth=bandwidth, latency=latency, config=config,
        new_token_ids=new_token_ids,
    )
    return {
        "link": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency},
        "transfer": "monolithic: computed as latency + bytes / bandwidth, then actually waited before decoding",
        "bytes": {"anchor": tl.anchor_bytes, "residual": tl.residual_bytes, "monolithic-bf16": bf16_bytes(full_kv)},
        "rows": tt_rows(lynx, baselines),
        "judge": judge(lynx, baselines),
        "baseline_stats": {name: res.stats.to_dict() for name, (_, res) in baselines.items()},
    }
