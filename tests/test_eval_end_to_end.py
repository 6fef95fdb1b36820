"""`lynxkv eval` end to end on a tiny random Llama with a byte-level tokenizer, and on a KV dump."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama

from lynxkv.eval import draft, harness


def run_cli(args: list[str]) -> int:
    from lynxkv.cli import app, main

    # While `eval` is the only registered command, typer runs it without its name.
    single = len(app.registered_commands) == 1 and not app.registered_groups and app.registered_callback is None
    return main(args[1:] if single and args[:1] == ["eval"] else args)


def byte_tokenizer():
    """A 256-token byte-level tokenizer built offline (no merges), enough to feed built-in prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(3, vocab=256).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def test_queries_captured_by_the_hook_reproduce_the_models_attention(tiny_model):
    """Captured q (after RoPE) with the cache's keys/values and a causal mask give the attention output the
    model itself fed into o_proj."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (20,))
    kv, _ = draft.prefill(tiny_model, ids[:12])
    attn = draft._attention_modules(tiny_model)[0]
    seen = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("o_in", a[0].detach().clone()))
    try:
        cache = draft.kv_to_cache(kv)
        with draft.captured_queries(tiny_model) as store:
            tiny_model(input_ids=ids[12:].reshape(1, -1), cache=cache, use_cache=True)
    finally:
        hook.remove()
    q = store[0]  # [Hq, 8, D]
    k, v = cache.layers[0].keys[0], cache.layers[0].values[0]  # [H, 20, D]
    groups = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    logits = q @ kk.transpose(-1, -2) * attn.scaling  # [Hq, 8, 20]
    mask = torch.arange(20)[None, :] > (12 + torch.arange(8))[:, None]
    out = torch.softmax(logits.masked_fill(mask, float("-inf")), -1) @ vv  # [Hq, 8, D]
    expected = seen["o_in"][0].view(8, q.shape[0], -1).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_exact_cache_scores_perfectly_and_a_coarse_one_does_not(tiny_model):
    from lynxkv.eval.baselines import registry

    torch.manual_seed(1)
    ids = torch.randint(0, 128, (40,))
    heldout = torch.randint(0, 128, (8,))
    codecs = [registry()[n] for n in ("fp32", "kivi2")]
    scores = harness.score_prompt(tiny_model, ids, codecs, 12, heldout)
    exact = scores["fp32"]
    assert exact["agree"] == 1.0 and exact["prefix"] == 12
    assert exact["kl"] < 1e-9 and exact["attn_err"] == 0.0 and abs(exact["ppl_delta"]) < 1e-6
    coarse = scores["kivi2"]
    assert coarse["k_vnmse"] > 1e-3 and coarse["attn_err"] > 0 and coarse["kl"] > 1e-6


def test_cli_json_and_plots_on_a_tiny_model(tiny_dir, tmp_path, capsys):
    plots = tmp_path / "plots"
    names = "fp32,bf16,int4-tensor,int8-tensor,lynx-default,lynx-default-anchor"
    rc = run_cli(
        ["eval", "--model", tiny_dir, "--tokens", "80,120", "--prompts", "2", "--window", "8", "--heldout", "8",
         "--schemes", names, "--json", "--plot", str(plots)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert [b["tokens"] for b in result["lengths"]] == [80, 120]
    block = result["lengths"][1]
    assert len(block["prompt_tokens"]) == 2 and all(100 <= n <= 140 for n in block["prompt_tokens"])
    c = block["codecs"]
    assert list(c) == names.split(",")
    assert c["fp32"]["agree"] == 1.0 and c["fp32"]["prefix_mean"] == 8 and c["fp32"]["k_vnmse"] == 0.0
    assert c["fp32"]["prefix_curve"] == [1.0] * 9 and c["fp32"]["agree_prompts"] == [1.0, 1.0]
    assert c["int4-tensor"]["k_vnmse"] > c["int8-tensor"]["k_vnmse"] > c["lynx-default"]["k_vnmse"]
    assert c["lynx-default-anchor"]["bits"] < c["lynx-default"]["bits"]
    assert len(c["bf16"]["k_vnmse_layers"]) == 2
    assert c["fp32"]["ppl_delta"] == pytest.approx(0.0, abs=1e-9) and "ppl_delta" in c["int4-tensor"]
    assert c["fp32"]["agree_sem"] == 0.0 and c["int4-tensor"]["kl_sem"] >= 0.0
    for name in ("prefix_curve_80.png", "error_vs_bits_120.png", "quality_vs_bits_80.png", "quality_vs_bits_120.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_table_and_markdown(tiny_dir, capsys):
    rc = run_cli(["eval", "--model", tiny_dir, "--tokens", "60", "--prompts", "1", "--window", "4",
                  "--heldout", "0", "--prompt-offset", "5", "--schemes", "bf16,kivi4", "--markdown"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "| codec | bits/el | K vNMSE" in out and "| kivi4 |" in out
    assert "ΔPPL" not in out  # no held-out text, no perplexity column


def test_cli_on_a_kv_dump_and_its_errors(tmp_path, capsys):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    tensors = {f"past_key_values.{i}.{kind}": torch.randn(1, 2, 70, 16) for i in range(2) for kind in ("key", "value")}
    path = tmp_path / "kv.safetensors"
    save_file(tensors, str(path))
    rc = run_cli(["eval", "--kv", str(path), "--schemes", "int8-g64,kivi2", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    c = result["lengths"][0]["codecs"]
    assert result["kind"] == "kv" and result["lengths"][0]["tokens"] == 70
    assert 0 < c["int8-g64"]["k_vnmse"] < c["kivi2"]["k_vnmse"]
    assert "agree" not in c["kivi2"]

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    assert run_cli(["eval", "--kv", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.safetensors" in err and "Traceback" not in err
    assert run_cli(["eval", "--kv", str(path), "--schemes", "int9"]) == 1
    assert "unknown codec 'int9'" in capsys.readouterr().err


def test_cli_on_user_text(tiny_dir, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time a lynx cached its keys. " * 12, encoding="utf-8")  # 492 bytes = tokens
    rc = run_cli(["eval", "--model", tiny_dir, "--text", str(text), "--tokens", "100", "--prompts", "9",
                  "--window", "4", "--heldout", "20", "--schemes", "fp32", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    block = json.loads(captured.out)["lengths"][0]
    assert block["prompt_tokens"] == [100] * 4  # 492 // (100 + 20) pieces
    assert run_cli(["eval", "--model", tiny_dir, "--text", str(text), "--tokens", "600"]) == 1
    assert "fewer than one prompt" in capsys.readouterr().err


def test_stdlib_corpus_is_held_out_from_the_builtin_prompts(tiny_dir, capsys):
    from lynxkv.eval.cases import stdlib_text
    from lynxkv.hf.prompts import document

    text = stdlib_text()
    assert "def " in text and "import " in text and len(text) > 300_000
    assert document(0, min_chars=2000)[:200] not in text  # the choosing corpus is not in the reporting one
    rc = run_cli(["eval", "--model", tiny_dir, "--corpus", "stdlib", "--tokens", "100", "--prompts", "3",
                  "--window", "4", "--heldout", "8", "--schemes", "fp32,int4-tensor", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert result["corpus"] == "held-out stdlib source"
    assert result["lengths"][0]["prompt_tokens"] == [100] * 3
    assert run_cli(["eval", "--model", tiny_dir, "--corpus", "manpages"]) == 1
    assert "--corpus: expected builtin or stdlib" in capsys.readouterr().err


def test_heldout_text_continues_the_document_after_the_prompt():
    from lynxkv.eval.cases import builtin_case, prompt_starts
    from lynxkv.hf.prompts import QUESTION, document

    tok = byte_tokenizer()
    starts = prompt_starts(3)
    assert len(set(starts)) == 3
    ids, held = builtin_case(tok, 200, starts[1], 40)
    text = tok.decode(ids.tolist())
    assert text.endswith(QUESTION) and held.numel() == 40
    doc_part = text[: -len(QUESTION)]
    assert document(starts[1], min_chars=5000).startswith(doc_part + tok.decode(held.tolist()))
    assert builtin_case(tok, 200, starts[1], 0)[1] is None


@pytest.mark.slow
def test_smollm2_default_scheme_drafts_well_and_the_paper_ordering_holds(smollm2):
    """On the real model (one ~500-token prompt, W = 32): the anchor drafts most tokens right, the full code
    is near-exact, and per-tensor INT4 >> per-tensor INT8 >> lynx full in vNMSE."""
    from lynxkv.eval import baselines, suite

    names = "fp32,int4-tensor,int8-tensor,lynx-default,lynx-default-anchor"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = suite.evaluate_model(
            smollm2, baselines.select(names), lengths=[500], prompts=1, window=32, heldout=0, prompt_offset=40
        )
    finally:
        torch.set_num_threads(threads)
    c = result["lengths"][0]["codecs"]
    assert c["fp32"]["agree"] == 1.0 and c["fp32"]["kl"] < 1e-9
    assert c["lynx-default"]["kl"] < 2e-3 and c["lynx-default"]["agree"] >= 0.9
    assert c["lynx-default-anchor"]["kl"] < 0.1 and c["lynx-default-anchor"]["agree"] >= 0.8
    for kind in ("k_vnmse", "v_vnmse"):
        assert c["int4-tensor"][kind] > 10 * c["int8-tensor"][kind] > 10 * c["lynx-default"][kind]
