"""Greedy Lynx output on the real SmolLM2 equals greedy decoding on the full cache (fp32), in the three regimes."""

from __future__ import annotations

import pytest

from lynxkv.hf import prefill
from lynxkv.hf.models import encode_prompt
from lynxkv.hf.prompts import builtin_prompt
from lynxkv.quant.scheme import get_scheme
from lynxkv.speculative import RunConfig, decode_plain, run
from lynxkv.speculative.simulated import split_kv
from lynxkv.speculative.model_ops import forward_tokens, start_cache
from runner_helpers import StepLoad, perturbed, single_thread

pytestmark = pytest.mark.slow
NEW = 16
_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module", params=[(120, 0), (300, 17)], ids=["120tok", "300tok"])
def prompt_case(request, smollm2):
    tokens, start = request.param
    ids = encode_prompt(smollm2, builtin_prompt(smollm2.tokenizer, tokens, start=start))
    kv, _ = prefill(smollm2.model, ids)
    anchor_kv, full_kv = split_kv(kv, get_scheme())
    ids = ids.tolist()
    return smollm2, ids, kv, anchor_kv, full_kv, decode_plain(smollm2.model, full_kv, ids, NEW)


def _gap(model, full_kv, ids, got, want) -> str:
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if j is None:
        return "same"
    logits = forward_tokens(model, start_cache(model, full_kv, len(ids)), [ids[-1]] + want[:j])[-1]
    top = logits.topk(2).values
    return f"first difference at {j}: top-2 logit gap {float(top[0] - top[1]):.3e}"


@pytest.mark.parametrize("regime", ["real-anchor", "exact-anchor", "coarse-anchor", "residual-first"])
def test_greedy_identical(prompt_case, regime):
    loaded, ids, kv, anchor_kv, full_kv, want = prompt_case
    model = loaded.model
    window = 0 if regime == "residual-first" else 10
    anchor = {"exact-anchor": full_kv, "coarse-anchor": perturbed(kv, 2.0, 0)}.get(regime, anchor_kv)
    res = run(model, StepLoad(model, ids, anchor, full_kv, fingerprint=loaded.fingerprint),
              RunConfig(max_new_tokens=NEW, max_window=window), fingerprint=loaded.fingerprint)
    assert res.token_ids == want, _gap(model, full_kv, ids, res.token_ids, want)
    s = res.stats
    print(regime, len(ids), 'drafted', s.drafted, 'accepted', s.accepted)
    assert s.drafted == window
    if regime == "exact-anchor":
        assert s.accepted == window
    if regime == "coarse-anchor":
        assert s.accepted < window
