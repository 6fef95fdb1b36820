"""Greedy Lynx decoding equals greedy decoding on the full cache, token for token (fp32, tiny random models)."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import make_tiny_llama
from lynxkv.cache.loading import PreparedLoad
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import RunConfig, decode_plain, run, stream
from runner_helpers import single_thread, StepLoad, caches, perturbed, prompt_ids


_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def models():
    return {seed: make_tiny_llama(seed) for seed in (0, 1, 2)}


def _logit_gap_report(model, full_kv, ids, got, want):
    """Where the two sequences first differ, the reference's top-2 logit gap there (a near-tie explains it)."""
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    from lynxkv.speculative.model_ops import forward_tokens, start_cache

    cache = start_cache(model, full_kv, len(ids) - 1)
    logits = forward_tokens(model, cache, [ids[-1]] + want[:j])[-1]
    top = logits.topk(2).values
    return f"first difference at {j}: top-2 logit gap {float(top[0] - top[1]):.3e}"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("length", [1, 2, 33, 100])
@pytest.mark.parametrize("window", [0, 1, 5, 24])
def test_greedy_matches_full_cache(models, seed, length, window):
    model = models[seed]
    ids = prompt_ids(seed, length)
    _, anchor_kv, full_kv = caches(model, ids)
    want = decode_plain(model, full_kv, ids, 40)
    load = StepLoad(model, ids, anchor_kv, full_kv)
    res = run(model, load, RunConfig(max_new_tokens=40, max_window=window))
    assert res.stats.drafted == min(window, 40)
    assert res.token_ids == want, _logit_gap_report(model, full_kv, ids, res.token_ids, want)
    assert res.verified and res.stats.committed == 40


@pytest.mark.parametrize("window", [1, 8, 30])
def test_every_draft_accepted_when_anchor_is_exact(models, window):
    model = models[0]
    ids = prompt_ids(5, 50)
    _, _, full_kv = caches(model, ids)
    res = run(model, StepLoad(model, ids, full_kv, full_kv), RunConfig(max_new_tokens=32, max_window=window))
    assert res.stats.drafted == window and res.stats.accepted == window and res.stats.verify_passes == 1
    assert res.token_ids == decode_plain(model, full_kv, ids, 32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_draft_rejected_with_coarse_anchor(models, seed):
    model = models[seed]
    ids = prompt_ids(seed + 10, 40)
    exact, _, full_kv = caches(model, ids)
    first = decode_plain(model, full_kv, ids, 1)[0]
    # a coarse anchor whose own first greedy token differs from the full cache's (so draft 0 must be rejected)
    coarse = next(
        c for c in (perturbed(exact, 3.0, s) for s in range(seed, seed + 20)) if decode_plain(model, c, ids, 1)[0] != first
    )
    res = run(model, StepLoad(model, ids, coarse, full_kv), RunConfig(max_new_tokens=20, max_window=6))
    assert res.stats.drafted == 6 and res.stats.accepted == 0 and res.stats.verify_passes == 1
    assert res.token_ids == decode_plain(model, full_kv, ids, 20)


def test_residual_before_any_draft(models):
    model = models[1]
    ids = prompt_ids(3, 30)
    _, anchor_kv, full_kv = caches(model, ids)
    fp = model_fingerprint(model)
    load = PreparedLoad(anchor_kv, full_kv, anchor_delay=0.05, residual_delay=0.0, prompt_token_ids=ids, model_fingerprint=fp)
    res = run(model, load, RunConfig(max_new_tokens=16, max_window=16))
    assert res.stats.drafted == 0 and res.stats.first_draft_s is None
    assert res.token_ids == decode_plain(model, full_kv, ids, 16)


@pytest.mark.parametrize("delay", [0.01, 0.04, 0.15])
def test_wall_clock_residual(models, delay):
    """A real background delay: however many drafts fit, the output is the full cache's."""
    model = models[2]
    ids = prompt_ids(7, 60)
    _, anchor_kv, full_kv = caches(model, ids)
    fp = model_fingerprint(model)
    started = time.perf_counter()
    load = PreparedLoad(anchor_kv, full_kv, residual_delay=delay, prompt_token_ids=ids, model_fingerprint=fp)
    res = run(model, load, RunConfig(max_new_tokens=48, max_window=64), started_at=started)
    assert res.token_ids == decode_plain(model, full_kv, ids, 48)
    s = res.stats
    assert s.residual_ready_s is not None and s.residual_ready_s >= delay * 0.9
    assert s.accepted <= s.drafted <= 48
    assert s.commit_times_s == sorted(s.commit_times_s) and s.committed == 48


def test_stop_token_ends_output(models):
    model = models[0]
    ids = prompt_ids(4, 20)
    _, anchor_kv, full_kv = caches(model, ids)
    plain = decode_plain(model, full_kv, ids, 30)
    stop = plain[9]
    want = plain[: plain.index(stop) + 1]
    for window in (0, 4, 30):
        res = run(model, StepLoad(model, ids, anchor_kv, full_kv), RunConfig(max_new_tokens=30, max_window=window, stop_token_ids=(stop,)))
        assert res.token_ids == want


def test_stream_events_replay_to_committed_text(models):
    """Applying draft / commit / retract events to a display buffer ends with exactly the committed tokens."""
    model = models[0]
    ids = prompt_ids(8, 40)
    exact, anchor_kv, full_kv = caches(model, ids)
    coarse = perturbed(exact, 1.0, 1)
    want = decode_plain(model, full_kv, ids, 24)
    for anchor in (anchor_kv, coarse, full_kv):
        final, provisional, kinds = [], [], []
        for ev in stream(model, StepLoad(model, ids, anchor, full_kv), RunConfig(max_new_tokens=24, max_window=10), provisional=True):
            kinds.append(ev.kind)
            if ev.kind == "draft":
                provisional.extend(ev.tokens)
            elif ev.kind == "commit":
                assert provisional[: ev.confirmed] == ev.tokens[: ev.confirmed]
                del provisional[: ev.confirmed]
                final.extend(ev.tokens)
            elif ev.kind == "retract":
                assert ev.count == len(provisional)
                del provisional[len(provisional) - ev.count :]
        assert final == want and not provisional and kinds[-1] == "done"
        assert kinds.count("draft") == 10


def test_sequence_vs_one_pass_logits_agree_in_fp32(models):
    """The premise of exactness: a multi-token forward and step-by-step decoding agree to ~1e-5 in fp32."""
    from lynxkv.speculative.model_ops import forward_tokens, start_cache

    model = models[0]
    ids = prompt_ids(9, 50)
    _, _, full_kv = caches(model, ids)
    toks = decode_plain(model, full_kv, ids, 16)
    one = forward_tokens(model, start_cache(model, full_kv, len(ids) - 1), [ids[-1]] + toks[:-1])
    cache = start_cache(model, full_kv, len(ids) - 1)
    seq = torch.stack([forward_tokens(model, cache, [t])[-1] for t in [ids[-1]] + toks[:-1]])
    assert (one - seq).abs().max() < 1e-4


@pytest.mark.parametrize("question", [False, True], ids=["continue", "new-question"])
def test_the_first_draft_forward_is_reported_apart_from_the_draft_step(models, monkeypatch, question):
    """The first forward on the fresh anchor cache grows it into new storage, which no later step pays; it is
    first_draft_step_s, and draft_step_s is the mean of the draft forwards after it (as decode_step_s is of the
    plain steps after the verify pass). After new prompt tokens the prefill grew the cache: every single-token
    draft counts. A slow first forward (0.5 s more, injected) shows in the one and not in the other."""
    from lynxkv.speculative import branch, request

    model = models[0]
    ids = prompt_ids(7, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    real, calls = request.forward_tokens, []

    def forward(model, cache, tokens):
        calls.append(len(tokens))
        if len(calls) == 1:
            time.sleep(0.5)
        return real(model, cache, tokens)

    for module in (request, branch):  # a draft step without a fork, or the verify and later steps
        monkeypatch.setattr(module, "forward_tokens", forward)
    new = prompt_ids(8, 3) if question else None
    res = run(model, StepLoad(model, ids, anchor_kv, full_kv), RunConfig(max_new_tokens=12, max_window=6),
              new_token_ids=new)
    s = res.stats
    assert s.drafted == 6
    # Six draft forwards of a tiny model take milliseconds each: with the slow one in, the mean would be >= 0.5 / 6.
    if question:  # the prefill (3 tokens) was the slow one and is no draft step
        assert s.first_draft_step_s is None and s.draft_step_s < 0.05
    else:
        assert s.first_draft_step_s >= 0.5 and s.draft_step_s < 0.05
