"""`lynxkv eval` end to end on a tiny random Llama with a byte-level tokenizer, and on a KV dump."""

from __future__ import annotations

import json
import random

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


def random_words(seed: int, count: int) -> str:
    """Words drawn at random: text in which no run of 32 bytes repeats."""
    rng = random.Random(seed)
    words = "lynx anchor residual page chunk scale offset draft verify token stream link tier cache".split()
    return " ".join(rng.choice(words) for _ in range(count))


def test_cli_json_and_plots_on_a_tiny_model(tiny_dir, tmp_path, capsys):
    plots = tmp_path / "plots"
    names = "fp32,bf16,int4-tensor,int8-tensor,lynx-default,lynx-default-anchor"
    rc = run_cli(
        ["eval", "--model", tiny_dir, "--tokens", "80,120", "--prompts", "2", "--window", "8", "--ppl-tokens", "8",
         "--schemes", names, "--json", "--plot", str(plots)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert [c["role"] for c in result["corpora"]] == ["heldout", "choosing"]  # both by default, held-out first
    held, choosing = result["corpora"]
    assert "standard-library" in held["name"] and "built-in" in choosing["name"]
    assert [b["tokens"] for b in held["lengths"]] == [b["tokens"] for b in choosing["lengths"]] == [80, 120]
    assert held["lengths"][0]["prompt_tokens"] == [80, 80]  # cut from the text at exactly the length asked
    block = choosing["lengths"][1]
    assert len(block["prompt_tokens"]) == 2 and all(100 <= n <= 140 for n in block["prompt_tokens"])
    for block in (held["lengths"][1], choosing["lengths"][1]):
        c = block["codecs"]
        assert list(c) == names.split(",")
        assert c["fp32"]["agree"] == 1.0 and c["fp32"]["prefix_mean"] == 8 and c["fp32"]["k_vnmse"] == 0.0
        assert c["fp32"]["prefix_curve"] == [1.0] * 9 and c["fp32"]["agree_prompts"] == [1.0, 1.0]
        assert c["int4-tensor"]["k_vnmse"] > c["int8-tensor"]["k_vnmse"] > c["lynx-default"]["k_vnmse"]
        assert c["lynx-default-anchor"]["bits"] < c["lynx-default"]["bits"]
        assert len(c["bf16"]["k_vnmse_layers"]) == 2
        assert c["fp32"]["ppl_delta"] == pytest.approx(0.0, abs=1e-9) and "ppl_delta" in c["int4-tensor"]
        assert c["fp32"]["agree_sem"] == 0.0 and c["int4-tensor"]["kl_sem"] >= 0.0
        assert len(c["int4-tensor"]["ppl_delta_prompts"]) == 2 and c["int4-tensor"]["ppl_delta_sem"] >= 0.0
    assert held["lengths"][0]["codecs"]["int4-tensor"]["agree_prompts"] != \
        choosing["lengths"][0]["codecs"]["int4-tensor"]["agree_prompts"]  # two corpora, two sets of scores
    for role in ("heldout", "choosing"):
        for name in (f"prefix_curve_{role}_80.png", f"error_vs_bits_{role}_120.png",
                     f"quality_vs_bits_{role}_80.png", f"quality_vs_bits_{role}_120.png"):
            assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(result["plots"]) == sorted(str(p) for p in plots.iterdir())


def test_quality_plot_names_every_codec_without_overlapping_labels(tmp_path):
    """The frontier plot writes every codec's name beside its point, and labels of codecs at the same bits
    (here five at 5.03, as lynx anchors and KIVI-4 are) do not cover each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lynxkv.eval import report

    names = [f"codec-{i}" for i in range(5)] + ["kivi4", "lynx-x"]
    fig, ax = plt.subplots()
    points = [(5.03, 0.95 + 0.001 * i, n) for i, n in enumerate(names[:5])] + [(5.01, 0.951, "kivi4"),
                                                                                  (9.03, 0.99, "lynx-x")]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    report._place_labels(ax, points)
    fig.canvas.draw()
    texts = ax.texts
    assert sorted(t.get_text() for t in texts) == sorted(names)
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, renderer=fig.canvas.get_renderer()) for t in texts]  # the text, no leader
    for i in range(len(boxes)):
        for j in range(i):
            assert not boxes[i].overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    plt.close(fig)


def test_cli_table_and_markdown(tiny_dir, capsys):
    rc = run_cli(["eval", "--model", tiny_dir, "--tokens", "60", "--prompts", "1", "--window", "4",
                  "--ppl-tokens", "0", "--schemes", "bf16,kivi4", "--markdown"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "| codec | bits/el | K vNMSE" in out and "| kivi4 |" in out
    assert "ΔPPL" not in out  # no continuation, no perplexity column
    held, choosing = out.index("**HELD-OUT"), out.index("**CHOOSING")
    assert held < choosing  # the table to report comes first, and says so
    assert "Python standard-library source" in out[held:choosing] and "built-in prompts" in out[choosing:]


def test_the_scheme_chosen_per_prompt_scores_as_the_candidate_it_chose(tiny_dir, capsys):
    """``lynx-chosen`` and ``lynx-chosen-anchor`` are, prompt by prompt, the full code and the anchor of the one
    candidate the prompt's cache chose (one choice for both), and the table counts the choices."""
    from lynxkv.hf.choose import LABELS

    pairs = [(f"lynx-{label}", f"lynx-{label}-anchor") for label in LABELS]
    names = [n for pair in pairs for n in pair] + ["lynx-chosen", "lynx-chosen-anchor"]
    args = ["eval", "--model", tiny_dir, "--corpus", "heldout", "--tokens", "120", "--prompts", "3", "--window", "6",
            "--ppl-tokens", "6", "--schemes", ",".join(names)]
    assert run_cli([*args, "--json"]) == 0
    codecs = json.loads(capsys.readouterr().out)["corpora"][0]["lengths"][0]["codecs"]
    choices = codecs["lynx-chosen"]["choices"]
    assert len(choices) == 3 and set(choices) <= set(range(len(LABELS)))
    assert codecs["lynx-chosen-anchor"]["choices"] == choices
    for suffix, part in (("", 0), ("-anchor", 1)):
        for key in ("agree_prompts", "kl_prompts", "ppl_delta_prompts"):
            got = codecs[f"lynx-chosen{suffix}"][key]
            assert got == [codecs[pairs[c][part]][key][i] for i, c in enumerate(choices)], key
    assert run_cli([*args, "--markdown"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| lynx-chosen |"))
    assert all(f"{LABELS[c]} {choices.count(c)}" in row for c in set(choices))


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
    block = result["corpora"][0]["lengths"][0]
    c = block["codecs"]
    assert result["kind"] == "kv" and block["tokens"] == 70
    assert 0 < c["int8-g64"]["k_vnmse"] < c["kivi2"]["k_vnmse"]
    assert "agree" not in c["kivi2"]

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    assert run_cli(["eval", "--kv", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.safetensors" in err and "Traceback" not in err
    assert run_cli(["eval", "--kv", str(path), "--schemes", "int9"]) == 1
    assert "unknown codec 'int9'" in capsys.readouterr().err
    assert run_cli(["eval", "--kv", str(path), "--heldout-text", str(path)]) == 1
    assert "--kv excludes" in capsys.readouterr().err


def test_cli_on_user_heldout_text(tiny_dir, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time a lynx cached its keys. " * 12, encoding="utf-8")  # 492 bytes = tokens
    other = tmp_path / "other.txt"
    other.write_text(random_words(0, 200), encoding="utf-8")
    rc = run_cli(["eval", "--model", tiny_dir, "--heldout-text", str(text), "--heldout-text", str(other),
                  "--corpus", "heldout", "--tokens", "100", "--prompts", "20", "--window", "4", "--ppl-tokens", "20",
                  "--schemes", "fp32", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    (corpus,) = json.loads(captured.out)["corpora"]
    assert corpus["role"] == "heldout" and corpus["name"] == f"text from {text}, {other}"
    block = corpus["lengths"][0]
    # the story repeats one 41-byte sentence: its first piece is kept, the next three repeat it and are skipped;
    # the piece across the two files holds only 12 bytes of the story; the random words' pieces are all kept
    assert block["skipped_overlapping"] == 3
    assert len(block["prompt_tokens"]) == (492 + 2 + len(other.read_text())) // 120 - 3
    assert run_cli(["eval", "--model", tiny_dir, "--heldout-text", str(text), "--tokens", "600"]) == 1
    assert "give no prompt of 600 tokens" in capsys.readouterr().err
    assert run_cli(["eval", "--model", tiny_dir, "--heldout-text", str(tmp_path / "missing.txt")]) == 1
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert run_cli(["eval", "--model", tiny_dir, "--corpus", "choosing", "--heldout-text", str(text)]) == 1
    assert "--heldout-text needs the held-out corpus" in capsys.readouterr().err
    assert run_cli(["eval", "--model", tiny_dir, "--corpus", "stdlib"]) == 1
    assert "--corpus: expected one of both, heldout, choosing" in capsys.readouterr().err


def _runs(ids: list[int], n: int = 32) -> set[tuple]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def test_prompts_of_the_two_corpora_never_overlap():
    """Every held-out prompt (and its continuation) shares no 32-token run with any choosing prompt, nor with
    another held-out prompt, at every length; text copied from the choosing corpus into a held-out file is
    skipped, and the pieces around it are kept."""
    from lynxkv.eval.cases import CHOOSING, Corpus, choosing_runs, corpus_cases, stdlib_corpus
    from lynxkv.hf.prompts import document

    tok = byte_tokenizer()
    avoid = choosing_runs(tok)
    for tokens in (200, 1000):
        chosen, _ = corpus_cases(CHOOSING, tok, tokens, 6, 16, avoid)
        choosing = set().union(*(_runs(ids.tolist() + cont.tolist()) for ids, cont in chosen))
        held, _ = corpus_cases(stdlib_corpus(), tok, tokens, 6, 16, avoid)  # bytes: long indents are skipped
        assert len(held) == 6
        pieces = [_runs(ids.tolist() + cont.tolist()) for ids, cont in held]
        for i, runs in enumerate(pieces):
            assert runs.isdisjoint(choosing)
            assert all(runs.isdisjoint(other) for other in pieces[:i])

    own = random_words(1, 600)
    copied = Corpus("heldout", "mixed", own[:1500] + document(3, min_chars=900)[:900] + own[1500:])
    held, skipped = corpus_cases(copied, tok, 200, 50, 0, avoid)
    assert skipped >= 4 and len(held) >= 6
    text = [tok.decode(ids.tolist()) for ids, _ in held]
    assert not any(document(3, min_chars=900)[100:164] in t for t in text)
    assert all(_runs(ids.tolist()).isdisjoint(_runs(tok(document(3, min_chars=900)).input_ids)) for ids, _ in held)


def test_continuation_follows_the_document_after_the_prompt():
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
    """On the real model (one 500-token held-out prompt, W = 32): the anchor drafts most tokens right, the full code
    is near-exact, and per-tensor INT4 >> per-tensor INT8 >> lynx full in vNMSE."""
    from lynxkv.eval import baselines, suite
    from lynxkv.eval.cases import stdlib_corpus

    names = "fp32,int4-tensor,int8-tensor,lynx-default,lynx-default-anchor"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = suite.evaluate_model(
            smollm2, baselines.select(names), [stdlib_corpus()], lengths=[500], prompts=1, window=32, ppl_tokens=0
        )
    finally:
        torch.set_num_threads(threads)
    c = result["corpora"][0]["lengths"][0]["codecs"]
    assert c["fp32"]["agree"] == 1.0 and c["fp32"]["kl"] < 1e-9
    assert c["lynx-default"]["kl"] < 2e-3 and c["lynx-default"]["agree"] >= 0.9
    assert c["lynx-default-anchor"]["kl"] < 0.1 and c["lynx-default-anchor"]["agree"] >= 0.8
    for kind in ("k_vnmse", "v_vnmse"):
        assert c["int4-tensor"][kind] > 10 * c["int8-tensor"][kind] > 10 * c["lynx-default"][kind]
