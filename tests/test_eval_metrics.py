"""Metrics of lynxkv.eval on cases small enough to compute by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lynxkv.eval import metrics


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_vnmse_per_vector_and_global_differ_as_computed_by_hand():
    x = t([[[3.0, 4.0], [1.0, 0.0]]])  # [1, 2, 2]: norms² 25 and 1
    x_hat = t([[[3.0, 5.0], [0.0, 0.0]]])  # errors² 1 and 1
    assert metrics.vnmse_per_vector(x, x_hat) == pytest.approx((1 / 25 + 1 / 1) / 2)
    assert metrics.vnmse_global(x, x_hat) == pytest.approx(2 / 26)


def test_vnmse_skips_zero_vectors_and_is_zero_when_exact():
    x = t([[[0.0, 0.0], [2.0, 0.0]]])
    x_hat = t([[[0.5, 0.0], [1.0, 0.0]]])
    assert metrics.vnmse_per_vector(x, x_hat) == pytest.approx(1 / 4)  # the zero vector does not count
    assert metrics.vnmse_global(x, x) == 0.0
    assert metrics.vnmse_global(torch.zeros(1, 1, 2), torch.ones(1, 1, 2)) == math.inf


def test_attention_error_output_and_weights_by_hand():
    q = t([[[0.0, 0.0]]])  # [Hq=1, W=1, D=2]: zero query -> uniform weights
    k = t([[[5.0, 1.0], [-2.0, 3.0]]])
    v = t([[[1.0, 0.0], [0.0, 1.0]]])  # o = [0.5, 0.5]
    v_hat = t([[[1.0, 0.0], [0.0, 0.0]]])  # ô = [0.5, 0]
    rel, kl = metrics.attention_error(q, k, v, k, v_hat, scale=1.0)
    assert rel == pytest.approx(0.25 / 0.5)
    assert kl == pytest.approx(0.0, abs=1e-12)

    q = t([[[1.0, 0.0]]])
    k = t([[[math.log(2.0), 0.0], [0.0, 0.0]]])  # weights [2/3, 1/3]
    k_hat = torch.zeros_like(k)  # weights [1/2, 1/2]
    v = t([[[1.0, 0.0], [0.0, 1.0]]])
    rel, kl = metrics.attention_error(q, k, v, k_hat, v, scale=1.0)
    assert kl == pytest.approx(2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3))
    o, o_hat = torch.tensor([2 / 3, 1 / 3]), torch.tensor([0.5, 0.5])
    assert rel == pytest.approx(float((o_hat - o).pow(2).sum() / o.pow(2).sum()))


def test_attention_repeats_kv_heads_for_grouped_queries():
    torch.manual_seed(0)
    q = torch.randn(4, 3, 8)  # 4 query heads over 2 KV heads
    k, v = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    out, logw = metrics.attention(q, k, v)
    for h in range(4):
        kh, vh = k[h // 2].double(), v[h // 2].double()
        w1 = torch.softmax(q[h].double() @ kh.T / 8**0.5, dim=-1)  # [3, 5]
        torch.testing.assert_close(out[h], w1 @ vh)
        torch.testing.assert_close(logw[h].exp(), w1)
    with pytest.raises(ValueError):
        metrics.attention(torch.randn(3, 1, 8), k, v)


def test_next_token_kl_by_hand():
    exact = torch.log(t([[0.5, 0.5], [0.9, 0.1]]))
    approx = torch.log(t([[0.5, 0.5], [0.5, 0.5]]))
    kl = metrics.next_token_kl(exact, approx)
    assert kl[0] == pytest.approx(0.0, abs=1e-9)
    assert kl[1] == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel=1e-6)


def test_accepted_prefix_agreement_survival_and_exact_match():
    ref = torch.tensor([1, 2, 3, 4])
    assert metrics.accepted_prefix(ref, torch.tensor([1, 2, 9, 4])) == 2
    assert metrics.accepted_prefix(ref, ref.clone()) == 4
    assert metrics.accepted_prefix(ref, torch.tensor([0, 2, 3, 4])) == 0
    assert metrics.agreement(ref, torch.tensor([1, 2, 9, 4])) == 0.75
    assert metrics.survival_curve([0, 2, 4], 4) == pytest.approx([1.0, 2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert metrics.exact_match_rate([0, 2, 4], 4) == pytest.approx(1 / 3)
    assert metrics.exact_match_rate([0, 2, 4], 2) == pytest.approx(2 / 3)


def test_perplexity_and_mean_std():
    assert metrics.perplexity(torch.zeros(3, 4), torch.tensor([0, 1, 2])) == pytest.approx(4.0)
    logits = torch.log(t([[0.5, 0.25, 0.25]]))
    assert metrics.perplexity(logits, torch.tensor([0])) == pytest.approx(2.0)
    m, s = metrics.mean_std([1.0, 2.0, 3.0])
    assert (m, s) == (pytest.approx(2.0), pytest.approx(1.0))
