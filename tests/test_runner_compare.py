"""``run --compare --repeats``: every method repeated, interleaved round by round, verdicts judged on medians."""

from __future__ import annotations

import statistics

import pytest

from conftest import make_tiny_llama
from lynxkv.hf.models import model_fingerprint
from lynxkv.cache.loading import PreparedLoad
from lynxkv.speculative import RunConfig, RunResult, RunStats, run
from lynxkv.bench import compare
from runner_helpers import caches, prompt_ids, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def result(tt64: float, *, t_res: float = 2.0, tpot: float | None = None) -> RunResult:
    """A finished run whose 64th token was committed at ``tt64`` s (the anchor at 0 s, the residual at t_res)."""
    stats = RunStats(anchor_ready_s=0.0, residual_ready_s=t_res, decode_step_s=tpot,
                     commit_times_s=[tt64 * (i + 1) / 64 for i in range(64)])
    return RunResult(list(range(64)), stats)


def test_verdicts_are_judged_on_medians_and_every_round_is_kept():
    """One slow Lynx round (a busy machine) loses to the full code; the medians of three rounds gain 0.9 Δ, and
    every round's own figures are kept. Δ = min(median t_res, 64 · median TPOT of the full-code runs) = min(2.0, 64 · 0.05)."""
    runs = {
        "lynx": [(2.0, result(6.0)), (2.0, result(9.0)), (2.0, result(6.2))],
        "monolithic-bf16": [(3.0, result(8.0))] * 3,
        "monolithic-full": [(2.0, result(8.0, tpot=0.05)), (2.0, result(7.6, tpot=0.06)),
                            (2.0, result(8.1, tpot=0.05))],
        "anchor-only": [(1.0, result(5.5)), (1.0, result(5.4)), (1.0, result(5.6))],
    }
    j = compare.judge(runs)
    assert j["repeats"] == 3
    assert (j["tt_lynx_s"], j["tt_full_s"], j["tt_anchor_only_s"]) == pytest.approx((6.2, 8.0, 5.5))
    assert j["tpot_s"] == pytest.approx(0.05) and j["delta_theoretical_s"] == pytest.approx(2.0)
    assert j["gain_measured_s"] == pytest.approx(1.8)
    assert j["gain_over_delta"] == pytest.approx(0.9) and j["ratio_to_anchor_only"] == pytest.approx(6.2 / 5.5)
    assert [r["gain_over_delta"] for r in j["rounds"]] == pytest.approx([1.0, -0.7, 0.95])
    assert [r["ratio_to_anchor_only"] for r in j["rounds"]] == pytest.approx([6.0 / 5.5, 9.0 / 5.4, 6.2 / 5.6])
    assert [r["tt_lynx_s"] for r in j["rounds"]] == pytest.approx([6.0, 9.0, 6.2])

    rows = {r["method"]: r for r in compare.tt_rows(runs)}
    assert rows["lynx"]["tt64_s"] == pytest.approx(6.2) and rows["monolithic-full"]["tt64_s"] == pytest.approx(8.0)
    assert [r["tt64_s"] for r in rows["lynx"]["runs"]] == pytest.approx([6.0, 9.0, 6.2])
    assert all(r["same_tokens_as_lynx"] for r in rows.values())

    runs["lynx"][1] = (2.0, RunResult(list(range(63)), RunStats(commit_times_s=[0.1] * 63)))  # one run stopped early
    j = compare.judge(runs)
    assert j["tt_lynx_s"] is None and j["gain_over_delta"] is None  # no median is made up from the rest
    assert compare.tt_rows(runs)[0]["same_tokens_as_lynx"] is False


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(6, layers=2, head_dim=16)
    ids = prompt_ids(6, 120)
    _, anchor_kv, full_kv = caches(model, ids)
    fp = model_fingerprint(model)

    def open_load():
        return PreparedLoad(anchor_kv, full_kv, residual_delay=0.05, prompt_token_ids=ids, model_fingerprint=fp,
                            anchor_bytes=40_000, residual_bytes=30_000)

    return model, fp, open_load


def test_every_method_is_repeated_interleaved_with_the_order_rotated(tiny, monkeypatch):
    model, fp, open_load = tiny
    cfg = RunConfig(max_new_tokens=12)
    order, captured = [], {}
    real_cases, real_baseline, real_lynx = compare.baseline_cases, compare.run_baseline, compare.run_lynx

    def cases(*args):
        captured.update(real_cases(*args))
        return captured

    def baseline(model, case, *args, **kwargs):
        order.append(next(name for name, c in captured.items() if c is case))
        return real_baseline(model, case, *args, **kwargs)

    def lynx(*args, **kwargs):
        order.append("lynx")
        return real_lynx(*args, **kwargs)

    monkeypatch.setattr(compare, "baseline_cases", cases)
    monkeypatch.setattr(compare, "run_baseline", baseline)
    monkeypatch.setattr(compare, "run_lynx", lynx)
    load = open_load()
    try:
        first = run(model, load, cfg, fingerprint=fp)
        report = compare.compare_run(model, load, first, cfg, fp, bandwidth=1e7, latency=0.001, repeats=3,
                                     open_load=open_load)
    finally:
        load.close()
    assert order == ["monolithic-bf16", "monolithic-full", "anchor-only",  # round 0: after the caller's Lynx run
                     "monolithic-bf16", "monolithic-full", "anchor-only", "lynx",  # round 1: rotated by one
                     "monolithic-full", "anchor-only", "lynx", "monolithic-bf16"]  # round 2: by two
    assert report["repeats"] == 3
    assert {m: len(v) for m, v in report["stats"].items()} == dict.fromkeys(compare.METHODS, 3)
    for row in report["rows"]:
        assert len(row["runs"]) == 3 and row["same_tokens_as_lynx"]  # greedy: every run commits the same tokens
        assert row["tt1_s"] == statistics.median(r["tt1_s"] for r in row["runs"])
        assert row["ready_s"] == statistics.median(r["ready_s"] for r in row["runs"])
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["lynx"]["runs"][0]["tt1_s"] == first.stats.tt(1)  # the caller's run is round 0
    assert rows["monolithic-full"]["ready_s"] == pytest.approx(0.001 + 70_000 / 1e7)
    assert len(report["judge"]["rounds"]) == 3


def test_repeating_needs_a_fresh_load_and_a_positive_count(tiny):
    model, fp, open_load = tiny
    cfg = RunConfig(max_new_tokens=4)
    load = open_load()
    try:
        first = run(model, load, cfg, fingerprint=fp)
        with pytest.raises(Exception, match="open_load"):
            compare.compare_run(model, load, first, cfg, fp, bandwidth=1e7, latency=None, repeats=2)
        with pytest.raises(Exception, match="--repeats"):
            compare.compare_run(model, load, first, cfg, fp, bandwidth=1e7, latency=None, repeats=0)
    finally:
        load.close()
