"""Drafting only where it pays, decided from what the engine can know: this machine's measured decode step
(:class:`lynxkv.speculative.Timing`) and the residual's ETA from the bytes seen arriving, never a link's rate."""

from __future__ import annotations

import os

import pytest

from conftest import make_tiny_llama
from lynxkv.cache.loading import PreparedLoad
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import RunConfig, Timing, decode_plain, run
from lynxkv.speculative import timing as timing_module
from runner_helpers import caches, prompt_ids, single_thread, store_prefill

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def setup():
    model = make_tiny_llama(8, layers=2, head_dim=16)
    ids = prompt_ids(8, 100)
    _, anchor_kv, full_kv = caches(model, ids)
    return model, ids, anchor_kv, full_kv


def _load(setup, delay):
    model, ids, anchor_kv, full_kv = setup
    return PreparedLoad(anchor_kv, full_kv, residual_delay=delay, prompt_token_ids=ids,
                        model_fingerprint=model_fingerprint(model))


def test_a_residual_due_within_the_minimum_window_is_waited_for(setup):
    model, ids, _, full_kv = setup
    want = decode_plain(model, full_kv, ids, 8)
    # due in ~0.2 s, a step known to cost 0.15 s: under 4 steps, so no draft is made
    res = run(model, _load(setup, 0.2), RunConfig(max_new_tokens=8), timing=Timing(0.15, len(ids)))
    assert res.stats.drafted == 0 and res.stats.draft_steps == []
    assert "waiting for it instead of drafting" in res.stats.drafting_disabled
    assert res.token_ids == want
    # the same residual with a step known to cost 0.01 s: about 20 steps of window, so it drafts
    res = run(model, _load(setup, 0.2), RunConfig(max_new_tokens=8), timing=Timing(0.01, len(ids)))
    assert res.stats.drafted > 0 and res.stats.drafting_disabled is None
    assert res.token_ids == want
    # no step known: it drafts
    res = run(model, _load(setup, 0.2), RunConfig(max_new_tokens=8))
    assert res.stats.drafted > 0 and res.token_ids == want


def test_the_step_estimate_scales_with_the_cache_length():
    timing = Timing()
    assert timing.step(1000) is None
    timing.note_step(1000, 0.05)
    assert timing.step(1000) == pytest.approx(0.05)
    assert timing.step(2000) == pytest.approx(0.10)  # scaled by the cache length
    assert timing.step(5000) is None  # too far from what was measured
    assert timing.wait_reason(0.15, 1000) is not None  # 0.15 s < 4 x 0.05 s
    assert timing.wait_reason(0.25, 1000) is None
    assert timing.wait_reason(None, 1000) is None  # no ETA: draft


def test_a_run_hands_its_decode_step_to_its_timing(setup):
    model, ids, _, _ = setup
    timing = Timing()
    res = run(model, _load(setup, 0.0), RunConfig(max_new_tokens=6), timing=timing)
    assert res.stats.decode_step_s is not None
    assert timing.step(len(ids)) == pytest.approx(res.stats.decode_step_s, rel=0.1)


def test_the_verify_cost_is_learned_from_a_measured_verify():
    timing = Timing()
    assert timing.verify_estimate(10, 0.1) == pytest.approx(0.1 * (1 + timing_module.ROW_COST * 10))
    timing.note_verify(10, 0.6, 0.1)  # 6 steps for 10 rows: half a step per row
    assert timing.verify_estimate(20, 0.1) == pytest.approx(0.1 * (1 + 0.5 * 20))
    assert timing.verify_estimate(20, 0.1, batch=True) == pytest.approx(0.1 * (1 + timing_module.ROW_COST * 20))


def test_calibrate_measures_a_step_at_the_caches_length():
    model = make_tiny_llama(10, layers=2, head_dim=16)
    timing = Timing()
    assert timing.calibrate(model, 0) is None  # nothing cached: nothing to measure
    seconds = timing.calibrate(model, 300)
    assert seconds is not None and seconds > 0
    assert timing.step(300) == pytest.approx(seconds)
    # a residual due within 3 of those steps is waited for; one due well after them is drafted on
    assert timing.wait_reason(2.0 * seconds, 300) is not None
    assert timing.wait_reason(10.0 * seconds, 300) is None


def test_calibrate_bounds_the_cache_it_builds(monkeypatch):
    model = make_tiny_llama(11, layers=1, head_dim=16)
    whole = timing_module.CALIBRATE_WHOLE_TOKENS
    seen = []
    monkeypatch.setattr("lynxkv.speculative.model_ops.measure_tpot",
                        lambda m, kv, prompt_len, steps: seen.append((kv[0][0].shape[1], prompt_len)) or 0.01)
    timing = Timing()
    for tokens in (whole, whole + 10, 10 * whole):
        timing.calibrate(model, tokens)
        assert timing.step(tokens) is not None  # within the factor of two it is scaled by
    # the cache's own length up to CALIBRATE_WHOLE_TOKENS, beyond it no less than half the length
    assert seen == [(whole, whole + 1), (whole, whole + 1), (5 * whole, 5 * whole + 1)]


@pytest.mark.timing
def test_the_window_follows_the_bytes_not_the_links_configured_rate(tmp_path):
    """An emulated link that claims ten times its real rate: the engine never reads the claim. Its ETA comes from
    the bytes seen arriving, so with a step known to be short it drafts through the whole residual (the claimed rate
    would have made the residual look due within the minimum window, and the run would have waited), and the ETA
    it reads mid-way is the time the bytes then still took."""
    import time

    from lynxkv.bench.emulated_link import EmulatedLink
    from lynxkv.stream import open_progressive

    model = make_tiny_llama(5, layers=4, kv_heads=2, head_dim=64)
    ids = prompt_ids(5, 400)
    path = str(tmp_path / "c.lynx")
    full_kv = store_prefill(model, ids, path)
    residual_bytes = os.path.getsize(path + "r")
    rate = residual_bytes / 1.0  # the residual takes about a second
    link = EmulatedLink(rate)
    link.bandwidth = 10 * rate  # the claim; the bucket moves bytes at the real rate
    timing = Timing(0.02, len(ids))  # a step: 0.02 s; 4 steps = 0.08 s, well above 0.1 s of claimed transfer
    with open_progressive(path, link=link, block_size=8 << 10, inflight=1) as load:
        load.wait_anchor(60)
        while load.timeline.residual_bytes < residual_bytes // 2:
            time.sleep(0.01)
        eta, at = load.residual_eta(), time.perf_counter()
        load.residual.result(60)
        took = time.perf_counter() - at
    assert eta is not None and 0.5 * took <= eta <= 2.0 * took, (eta, took)

    with open_progressive(path, link=EmulatedLink(rate), block_size=8 << 10, inflight=1) as load:
        load.link.bandwidth = 10 * rate
        res = run(model, load, RunConfig(max_new_tokens=200, max_window=200), timing=timing)
    assert res.stats.drafting_disabled is None and res.stats.drafted >= 10, res.stats.drafted
    assert res.token_ids == decode_plain(model, full_kv, ids, 200, first_forward=res.stats.draft_token_ids,
                                         branch=(res.stats.branch_at, res.stats.branch_token_ids))
