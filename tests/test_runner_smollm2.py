"""Greedy Lynx output on the real SmolLM2 equals greedy decoding on the full cache (fp32), in the three regimes."""

from __future__ import annotations

import pytest

from lynxkv.hf import prefill
from lynxkv.hf.models import encode_prompt
from lynxkv.hf.prompts import builtin_prompt
from lynxkv.quant.scheme import get_scheme
from lynxkv.speculative import RunConfig, decode_plain, run
from lynxkv.bench.simulated import split_kv
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
    logits = forward_tokens(model, start_cache(model, full_kv, len(ids) - 1), [ids[-1]] + want[:j])[-1]
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


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_run_and_question_equal_plain_decoding(smollm2, tmp_path, dtype):
    """SmolLM2 in bf16/fp16, cache stored in that dtype: greedy output with and without a new question equals
    plain greedy decoding on the decoded full code with the run's forward shapes (decode_plain's definition)."""
    import torch

    from lynxkv import open_cache, save_cache
    from lynxkv.hf import continuation_ids
    from lynxkv.hf.models import load_model
    from lynxkv.cache.kv import TORCH_DTYPES

    lm = load_model(None, dtype=TORCH_DTYPES[dtype])
    ids = encode_prompt(lm, builtin_prompt(lm.tokenizer, 200))
    kv, _ = prefill(lm.model, ids)
    assert kv[0][0].dtype == TORCH_DTYPES[dtype]
    save_cache(tmp_path / "x.lynx", kv, prompt_token_ids=ids.tolist(), model_fingerprint=lm.fingerprint)
    with open_cache(tmp_path / "x.lynx") as cache:
        assert cache.info.dtype == dtype
        anchor_kv, full_kv = cache.load_kv(anchor_only=True), cache.load_kv()
    ids = ids.tolist()
    for new in (None, continuation_ids(lm.tokenizer, ids, "\n\nQuestion: Which topic comes first?\nAnswer:")):
        res = run(lm.model, StepLoad(lm.model, ids, anchor_kv, full_kv, fingerprint=lm.fingerprint),
                  RunConfig(max_new_tokens=NEW, max_window=8), new_token_ids=new, fingerprint=lm.fingerprint)
        want = decode_plain(lm.model, full_kv, ids, NEW, new_token_ids=new, first_forward=res.stats.draft_token_ids)
        assert res.token_ids == want and res.stats.drafted == 8
    with torch.no_grad():  # no NaN/inf from the low-precision path
        assert torch.isfinite(lm.model(input_ids=torch.tensor([ids[:8]])).logits).all()


def test_dynamic_cache_round_trip_through_a_file_keeps_generate_output(smollm2, tmp_path):
    """A SmolLM2 DynamicCache saved and opened again: generate continues a question with the same tokens as on
    the original cache (the full code is close enough to fp32 on a real model for these 16 tokens)."""
    import copy

    import torch
    from transformers import DynamicCache

    from lynxkv import open_cache, save_cache
    from lynxkv.hf import to_dynamic_cache

    lm = smollm2
    ids = encode_prompt(lm, builtin_prompt(lm.tokenizer, 300)).tolist()
    question = lm.tokenizer("\n\nQuestion: What is the first topic?\nAnswer:", add_special_tokens=False).input_ids
    original = DynamicCache()
    with torch.no_grad():
        lm.model(input_ids=torch.tensor([ids]), cache=original, use_cache=True)
    save_cache(tmp_path / "x.lynx", original, prompt_token_ids=ids)

    def generate(cache):
        with torch.no_grad():
            out = lm.model.generate(torch.tensor([ids + question]), cache=cache, max_new_tokens=NEW,
                                    do_sample=False)
        return out[0, len(ids) + len(question):].tolist()

    with open_cache(tmp_path / "x.lynx") as cache:
        assert generate(to_dynamic_cache(cache, lm.model)) == generate(copy.deepcopy(original))


def test_run_exact_on_bf16_smollm2_equals_greedy_decoding_on_the_original_cache(tmp_path, capsys):
    """``lynxkv run --exact`` on SmolLM2 in bf16: the drafts are verified against the exact segment, so the output
    is plain greedy decoding on the original bf16 cache (with the run's forward shapes)."""
    import json

    import torch

    from lynxkv import open_cache, save_cache
    from lynxkv.cli import main
    from lynxkv.hf.models import load_model

    lm = load_model(None, dtype=torch.bfloat16)
    ids = encode_prompt(lm, builtin_prompt(lm.tokenizer, 200, start=40))
    kv, _ = prefill(lm.model, ids)
    save_cache(tmp_path / "x.lynx", kv, prompt_token_ids=ids.tolist(), model_fingerprint=lm.fingerprint, exact=True)
    with open_cache(tmp_path / "x.lynx") as cache:
        exact = cache.load_kv(exact=True)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for p, q in zip(exact, kv) for a, b in zip(p, q))
    assert main(["run", str(tmp_path / "x.lynx"), "--dtype", "bf16", "-n", str(NEW), "--ignore-eos", "--exact",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] and doc["verified_against"] == "exact"
    want = decode_plain(lm.model, kv, ids.tolist(), NEW, first_forward=doc["stats"]["draft_token_ids"])
    assert doc["token_ids"] == want
