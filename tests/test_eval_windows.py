"""The accepted prefix over several windows per prompt (lynxkv.eval.windows), on a tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama
from lynxkv.eval import draft, harness, metrics
from lynxkv.eval.baselines import Lynx, registry, roundtrip_cache
from lynxkv.quant.scheme import get_scheme

W = 6


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(4, vocab=64)


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(5)
    return torch.randint(0, 64, (48,))


@pytest.fixture(scope="module")
def text():
    """The text after the prompt, along which the windows start."""
    torch.manual_seed(6)
    return torch.randint(0, 64, (3 * W,))


def _codecs(*names):
    return [registry()[n] for n in names]


def test_window_i_starts_after_the_prompt_and_i_windows_of_its_text(model, ids, text):
    """Window i scores exactly what one window scores on the prompt extended by the text's first i·W tokens; the
    perplexity change comes from the prompt alone, on the text's first ppl_tokens."""
    codecs = _codecs("fp32", "int4-tensor", "kivi2")
    three = harness.score_prompt(model, ids, codecs, W, text, windows_per_prompt=3, ppl_tokens=4)
    for i in range(3):
        one = harness.score_prompt(model, torch.cat([ids, text[: i * W]]), codecs, W, None)
        for c in codecs:
            assert three[c.name]["prefixes"][i] == one[c.name]["prefixes"][0]
            assert three[c.name]["prefix_ties"][i] == one[c.name]["prefix_ties"][0]
    alone = harness.score_prompt(model, ids, codecs, W, text[:4])
    for key in ("ppl_delta", "k_vnmse"):
        assert three["kivi2"][key] == alone["kivi2"][key]
    assert three["fp32"]["prefixes"] == [W] * 3 and three["fp32"]["prefix_ties"] == [False] * 3
    assert three["kivi2"]["prefix"] == pytest.approx(sum(three["kivi2"]["prefixes"]) / 3)
    assert any(p < W for p in three["kivi2"]["prefixes"])  # a coarse code breaks windows: the test can tell
    short = harness.score_prompt(model, ids, codecs, W, text[: W + 1], windows_per_prompt=3)
    assert len(short["fp32"]["prefixes"]) == 2  # a window the text is too short for is left out


def sharp_attention_model():
    """A tiny Llama whose attention is nearly one-hot (queries and keys scaled up), so that even the 8-bit full code
    moves an attention peak now and then: its greedy tokens part from the exact cache's."""
    model = make_tiny_llama(1, vocab=64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    return model


def test_a_lynx_anchor_is_also_measured_against_its_own_full_code(ids, text):
    """The prefix against the full code equals, window by window, an anchor draft teacher-forced on greedy
    decoding of the full-code cache (decoded here one token at a time, whatever the full code's agreement)."""
    model, scheme = sharp_attention_model(), get_scheme()
    anchor, full = Lynx("x-anchor", scheme, anchor_only=True), Lynx("x", scheme)
    scores = harness.score_prompt(model, ids, [anchor], W, text, windows_per_prompt=4, ppl_tokens=0)["x-anchor"]
    want, parted = [], False
    for i in range(4):
        ref = draft.build_reference(model, torch.cat([ids, text[: i * W]]), W)
        tokens = draft.greedy(model, roundtrip_cache(full, ref.prefix_kv), ref.last_token, W)
        parted |= not torch.equal(tokens, ref.tokens)
        drafted = draft.forward_logits(model, roundtrip_cache(anchor, ref.prefix_kv),
                                       draft.window_inputs(ref.last_token, tokens)).argmax(-1)
        want.append(metrics.accepted_prefix(tokens, drafted))
    assert scores["prefixes_full"] == want and len(scores["prefix_full_ties"]) == 4
    assert parted and scores["prefixes_full"] != scores["prefixes"]  # the two references differ on this model
    assert "prefixes_full" not in harness.score_prompt(model, ids, [full], W, None)["x"]


def test_near_ties_are_counted_apart(model, ids, text):
    codecs = _codecs("int4-tensor", "kivi2")
    per = [harness.score_prompt(model, ids, codecs, W, text, windows_per_prompt=4, tie_margin=m) for m in (0, 1e9)]
    for c in codecs:
        never, always = (harness.summarize([p], codecs, W)[c.name] for p in per)
        broken = [p for p in always["prefixes"] if p < W]
        assert never["prefix_ties"] == 0 and never["prefix_untied_mean"] == never["prefix_mean"]
        assert always["prefix_ties"] == len(broken) and always["windows"] == 4
        whole = [p for p in always["prefixes"] if p == W]
        assert always["prefix_untied_mean"] == (W if whole else None)
    margin = metrics.top2_margin(torch.tensor([[0.0, 3.0, 2.5], [1.0, 1.0, -2.0]]))
    assert torch.allclose(margin, torch.tensor([0.5, 0.0]))


def test_summary_pools_windows_with_their_standard_error(model, ids, text):
    codecs = _codecs("kivi2")
    prompts = [harness.score_prompt(model, ids[s:], codecs, W, text, windows_per_prompt=2) for s in (0, 9)]
    s = harness.summarize(prompts, codecs, W)["kivi2"]
    pooled = prompts[0]["kivi2"]["prefixes"] + prompts[1]["kivi2"]["prefixes"]
    mean, std = metrics.mean_std([float(p) for p in pooled])
    assert s["prefixes"] == pooled and s["windows"] == 4 and s["prompts"] == 2
    assert s["prefix_mean"] == pytest.approx(mean) and s["prefix_sem"] == pytest.approx(std / 2)
    assert s["prefix_curve"] == metrics.survival_curve(pooled, W)


def test_cli_windows_and_tie_margin(tmp_path, capsys):
    from lynxkv.cli import main
    from test_eval_end_to_end import byte_tokenizer

    make_tiny_llama(3, vocab=256).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    args = ["eval", "--model", str(tmp_path), "--corpus", "choosing", "--tokens", "60", "--prompts", "2",
            "--window", "4", "--windows", "3", "--ppl-tokens", "0", "--schemes", "fp32,lynx-default-anchor"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["windows"] == 3 and result["tie_margin"] == 0.1
    c = result["corpora"][0]["lengths"][0]["codecs"]
    assert c["fp32"]["windows"] == 6 and c["fp32"]["prefix_mean"] == 4 and c["fp32"]["prefix_ties"] == 0
    assert len(c["lynx-default-anchor"]["prefixes_full"]) == 6 and "prefix_full_mean" not in c["fp32"]
    assert main([*args, "--markdown"]) == 0
    table = capsys.readouterr().out
    assert "| ties |" in table and "| vs full |" in table and "3 windows per prompt" in table
    assert main([*args, "--tie-margin", "nan"]) == 1
    assert "--tie-margin" in capsys.readouterr().err
