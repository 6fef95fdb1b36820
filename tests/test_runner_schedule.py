"""Drafting only where it pays: with the residual due within a few decode steps of the anchor, the run waits."""

from __future__ import annotations

import pytest

from conftest import make_tiny_llama
from lynxkv.hf.models import model_fingerprint
from lynxkv.cache.loading import PreparedLoad
from lynxkv.speculative import RunConfig, decode_plain, run
from lynxkv.speculative import schedule
from runner_helpers import caches, prompt_ids, single_thread

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
    # due in ~0.2 s, a step taken to cost 0.15 s: under 2 steps, so no draft is made
    res = run(model, _load(setup, 0.2), RunConfig(max_new_tokens=8, step_estimate_s=0.15))
    assert res.stats.drafted == 0 and res.stats.draft_steps == []
    assert "waiting for it instead of drafting" in res.stats.drafting_disabled
    assert res.token_ids == want
    # the same link with a step taken to cost 0.01 s: about 20 steps of window, so it drafts
    res = run(model, _load(setup, 0.2), RunConfig(max_new_tokens=8, step_estimate_s=0.01))
    assert res.stats.drafted > 0 and res.stats.drafting_disabled is None
    assert res.token_ids == want
    # min_window_steps=0: always draft
    res = run(model, _load(setup, 0.2), RunConfig(max_new_tokens=8, step_estimate_s=0.15, min_window_steps=0))
    assert res.stats.drafted > 0 and res.token_ids == want


def test_the_step_estimate_comes_from_the_models_last_run():
    model = make_tiny_llama(9, layers=1, head_dim=16)
    assert schedule.step_estimate(model, 1000) is None
    schedule.remember_step(model, 1000, 0.05)
    assert schedule.step_estimate(model, 1000) == pytest.approx(0.05)
    assert schedule.step_estimate(model, 2000) == pytest.approx(0.10)  # scaled by the cache length
    assert schedule.step_estimate(model, 5000) is None  # too far from what was measured
    assert schedule.wait_reason(model, 0.08, 1000, 2.0) is not None  # 0.08 s < 2 x 0.05 s
    assert schedule.wait_reason(model, 0.12, 1000, 2.0) is None
    assert schedule.wait_reason(model, None, 1000, 2.0) is None  # no ETA: draft


def test_a_run_remembers_its_decode_step(setup):
    model, ids, _, _ = setup
    res = run(model, _load(setup, 0.0), RunConfig(max_new_tokens=6, min_window_steps=0))
    assert res.stats.decode_step_s is not None
    assert schedule.step_estimate(model, len(ids)) == pytest.approx(res.stats.decode_step_s, rel=0.1)


def test_calibrate_measures_and_remembers_a_step_at_the_caches_length():
    model = make_tiny_llama(10, layers=2, head_dim=16)
    assert schedule.step_estimate(model, 300) is None
    assert schedule.calibrate(model, 0) is None  # nothing cached: nothing to measure
    seconds = schedule.calibrate(model, 300)
    assert seconds is not None and seconds > 0
    assert schedule.step_estimate(model, 300) == pytest.approx(seconds)
    # a residual due within 3 of those steps is waited for; one due well after them is drafted on
    assert schedule.wait_reason(model, 2.0 * seconds, 300, schedule.MIN_WINDOW_STEPS) is not None
    assert schedule.wait_reason(model, 10.0 * seconds, 300, schedule.MIN_WINDOW_STEPS) is None


def test_calibrate_bounds_the_cache_it_builds(monkeypatch):
    model = make_tiny_llama(11, layers=1, head_dim=16)
    whole = schedule.CALIBRATE_WHOLE_TOKENS
    seen = []
    monkeypatch.setattr("lynxkv.speculative.model_ops.measure_tpot",
                        lambda m, kv, prompt_len, steps: seen.append((kv[0][0].shape[1], prompt_len)) or 0.01)
    for tokens in (whole, whole + 10, 10 * whole):
        schedule.calibrate(model, tokens)
        assert schedule.step_estimate(model, tokens) is not None  # within the factor of two it is scaled by
    # the cache's own length up to CALIBRATE_WHOLE_TOKENS, beyond it no less than half the length
    assert seen == [(whole, whole + 1), (whole, whole + 1), (5 * whole, 5 * whole + 1)]


def test_a_window_that_is_not_a_finite_number_is_refused():
    from lynxkv.errors import InputError

    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(InputError, match="min_window_steps"):
            RunConfig(min_window_steps=bad)


def test_the_default_window_is_the_clis(capsys, monkeypatch):
    from lynxkv.cli import main

    assert RunConfig().min_window_steps == schedule.MIN_WINDOW_STEPS
    monkeypatch.setenv("COLUMNS", "300")  # the option's help on one line
    assert main(["run", "--help"]) == 0
    assert f"(default {schedule.MIN_WINDOW_STEPS:g};" in capsys.readouterr().out
