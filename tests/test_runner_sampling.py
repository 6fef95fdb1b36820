"""Speculative sampling: the acceptance rule on hand-made distributions, and the end-to-end output distribution."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama
from lynxkv.errors import InputError
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import RunConfig, SamplingParams, accept_greedy, accept_sampled, logits_to_probs, run
from lynxkv.speculative.model_ops import forward_tokens, start_cache
from lynxkv.speculative.sampling import residual_distribution
from runner_helpers import single_thread, StepLoad, caches, perturbed, prompt_ids


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (cells with expected count < 5 pooled into one)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_greedy_rule():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    assert accept_greedy([1, 0], logits) == (2, 2)  # all accepted, bonus from the last row
    assert accept_greedy([1, 2], logits) == (1, 0)  # second rejected, replaced by the target argmax
    assert accept_greedy([0, 0], logits) == (0, 1)
    assert accept_greedy([], logits[:1]) == (0, 1)


def test_equal_distributions_always_accept():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, _ = accept_sampled([0, 2], p[:2], p, g)
        assert n == 2


def test_zero_target_mass_always_rejects_and_resamples_elsewhere():
    q = torch.tensor([[1.0, 0.0, 0.0]])
    p = torch.tensor([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n, tok = accept_sampled([0], q, p, g)
        assert n == 0 and tok in (1, 2)


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)


def test_one_step_output_distribution_equals_target():
    """Draft from q, verify against p: the committed first token is distributed as p (hand-made p, q)."""
    p = torch.tensor([0.05, 0.40, 0.15, 0.30, 0.10])
    q = torch.tensor([0.30, 0.10, 0.30, 0.05, 0.25])
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros(5)
    accepted = 0
    n_runs = 20000
    for _ in range(n_runs):
        d = int(torch.multinomial(q, 1, generator=g))
        n, tok = accept_sampled([d], q[None], torch.stack([p, p]), g)
        counts[d if n == 1 else tok] += 1
        accepted += n
    assert chi2_pvalue(counts, p) > 1e-3
    # acceptance probability is sum(min(p, q))
    assert abs(accepted / n_runs - float(torch.minimum(p, q).sum())) < 0.02


def test_top_p_and_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    full = logits_to_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(full, torch.softmax(logits, -1))
    cut = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert cut[2] == 0 and cut[3] == 0 and cut[:2].sum() == pytest.approx(1.0)  # 0.64 < 0.7: two tokens kept
    cold = logits_to_probs(logits, SamplingParams(temperature=0.1))
    assert cold[0] > 0.99
    with pytest.raises(InputError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(InputError, match="temperature"):
        SamplingParams(temperature=-1.0)


_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def small_vocab():
    model = make_tiny_llama(3, vocab=8)
    ids = prompt_ids(0, 24, vocab=8)
    exact, anchor_kv, full_kv = caches(model, ids)
    return model, ids, perturbed(exact, 2.0, 0), full_kv


@pytest.mark.parametrize("window", [2, 3])
def test_end_to_end_distribution_matches_full_cache(small_vocab, window):
    """Many seeded runs with 2 (or 3) drafted tokens on a coarse anchor, verified in one pass: the joint law of the first three committed tokens equals sampling on the full cache
    (computed exactly over the 8^3 sequences)."""
    model, ids, coarse, full_kv = small_vocab
    params = SamplingParams(temperature=0.1)  # peaked: the coarse draft law differs a lot from the target
    fp = model_fingerprint(model)
    V = 8

    # exact law of (t0, t1, t2) on the full cache
    cache = start_cache(model, full_kv, len(ids) - 1)
    p0 = logits_to_probs(forward_tokens(model, cache, [ids[-1]])[-1], params)
    base = full_kv
    joint = torch.zeros(V, V, V)
    for a in range(V):
        for b in range(V):
            c = start_cache(model, base, len(ids) - 1)
            rows = logits_to_probs(forward_tokens(model, c, [ids[-1], a, b]), params)  # [3, V]
            joint[a, b] = p0[a] * rows[1, b] * rows[2]
    joint = joint.reshape(-1)

    counts = torch.zeros(V**3)
    drafted = accepted = 0
    n_runs = 1500
    for seed in range(n_runs):
        res = run(
            model, StepLoad(model, ids, coarse, full_kv, fingerprint=fp),
            RunConfig(max_new_tokens=3, max_window=window, sampling=params, seed=seed), fingerprint=fp,
        )
        a, b, c = res.token_ids
        counts[(a * V + b) * V + c] += 1
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert 0 < accepted < drafted  # both branches (accept and reject/resample) were exercised
    assert chi2_pvalue(counts, joint) > 1e-3


def test_seed_reproducible(small_vocab):
    model, ids, coarse, full_kv = small_vocab
    cfg = RunConfig(max_new_tokens=12, max_window=5, sampling=SamplingParams(temperature=0.9, top_p=0.9), seed=7)
    a = run(model, StepLoad(model, ids, coarse, full_kv), cfg).token_ids
    b = run(model, StepLoad(model, ids, coarse, full_kv), cfg).token_ids
    c = run(model, StepLoad(model, ids, coarse, full_kv), RunConfig(**{**cfg.__dict__, "seed": 8})).token_ids
    assert a == b and len(a) == 12
    assert a != c
