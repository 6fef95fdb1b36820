"""Refusals and failure paths: wrong model, missing prompt ids, a residual that never arrives, the window policy."""

from __future__ import annotations

import time

import pytest

from conftest import make_tiny_llama
from lynxkv.errors import InputError, LynxError
from lynxkv.cache.loading import PreparedLoad
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import ResidualUnavailable, RunConfig, decode_plain, run, stream
from runner_helpers import StepLoad, caches, perturbed, prompt_ids, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def setup():
    model = make_tiny_llama(0)
    ids = prompt_ids(0, 30)
    exact, anchor_kv, full_kv = caches(model, ids)
    return model, ids, exact, anchor_kv, full_kv


def test_refuses_cache_of_another_model(setup):
    model, ids, _, anchor_kv, full_kv = setup
    other = make_tiny_llama(1)
    load = StepLoad(model, ids, anchor_kv, full_kv, fingerprint=model_fingerprint(other))
    with pytest.raises(InputError, match="another model"):
        run(model, load)


def test_refuses_cache_without_prompt_ids_or_fingerprint(setup):
    model, ids, _, anchor_kv, full_kv = setup
    load = StepLoad(model, ids, anchor_kv, full_kv)
    load.prompt_token_ids = None
    with pytest.raises(InputError, match="prompt token ids"):
        run(model, load)
    load = StepLoad(model, ids, anchor_kv, full_kv)
    load.model_fingerprint = None
    with pytest.raises(InputError, match="fingerprint"):
        run(model, load)


def test_refuses_kv_that_does_not_fit(setup):
    model, ids, _, anchor_kv, full_kv = setup
    with pytest.raises(InputError, match="prompt has 29"):
        run(model, StepLoad(model, ids[:-1], anchor_kv, full_kv))
    with pytest.raises(InputError, match="layers"):
        run(model, StepLoad(model, ids, anchor_kv[:1], full_kv))


@pytest.mark.parametrize("window", [0, 5])
def test_failed_residual_is_a_clear_error(setup, window):
    model, ids, _, anchor_kv, _ = setup
    load = StepLoad(model, ids, anchor_kv, None, error=LynxError("tier 'slow' unreachable"))
    with pytest.raises(ResidualUnavailable, match="unreachable.*anchor-only"):
        run(model, load, RunConfig(max_new_tokens=10, max_window=window))


def test_residual_timeout(setup):
    model, ids, _, anchor_kv, full_kv = setup
    load = PreparedLoad(anchor_kv, full_kv, residual_delay=30.0, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    try:
        with pytest.raises(ResidualUnavailable, match="within 0.2 s"):
            run(model, load, RunConfig(max_new_tokens=10, max_window=3, residual_timeout=0.2))
    finally:
        load.close()


def test_anchor_timeout(setup):
    """An anchor not in by ``anchor_timeout`` ends the run with one error, at that bound and not at the anchor's
    own (much later) time."""
    model, ids, _, anchor_kv, full_kv = setup
    load = PreparedLoad(anchor_kv, full_kv, anchor_delay=30.0, residual_delay=30.0, prompt_token_ids=ids,
                        model_fingerprint=model_fingerprint(model))
    t0 = time.perf_counter()
    try:
        with pytest.raises(LynxError, match="anchor did not arrive within 0.3 s"):
            run(model, load, RunConfig(max_new_tokens=4, anchor_timeout=0.3))
    finally:
        load.close()
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("window", [0, 4, 10])
def test_anchor_only_output_is_flagged(setup, window):
    """Only on request: the output continues on the anchor, equals plain decoding there, and says unverified."""
    model, ids, _, anchor_kv, _ = setup
    load = StepLoad(model, ids, anchor_kv, None, error=LynxError("source down"))
    events = list(stream(model, load, RunConfig(max_new_tokens=10, max_window=window, allow_anchor_only=True)))
    commits = [e for e in events if e.kind == "commit"]
    assert commits and all(not e.verified for e in commits)
    tokens = [t for e in commits for t in e.tokens]
    assert tokens == decode_plain(model, anchor_kv, ids, 10)
    stats = events[-1].stats
    assert stats.verified is False and "source down" in stats.residual_error


def test_eta_guard_waits_instead_of_drafting(setup):
    """When the residual is due within a fraction of a draft step, the request stops drafting and waits: here its
    load says it is due at once from the start, so it drafts the two steps the guard needs to judge a step by."""
    model, ids, _, anchor_kv, full_kv = setup
    fp = model_fingerprint(model)

    class Imminent(PreparedLoad):
        def residual_eta(self):
            return 0.0

    load = Imminent(anchor_kv, full_kv, residual_delay=0.3, prompt_token_ids=ids, model_fingerprint=fp)
    res = run(model, load, RunConfig(max_new_tokens=6, max_window=6))
    assert res.stats.waited_on_eta and res.stats.drafted == 2
    assert res.stats.residual_ready_s >= 0.25
    assert res.token_ids == decode_plain(model, full_kv, ids, 6)
