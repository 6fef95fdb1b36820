"""`lynxkv eval --task`: perplexity and passkey retrieval on each code's decoded cache."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama
from test_eval_end_to_end import byte_tokenizer, random_words, run_cli

from lynxkv.errors import InputError
from lynxkv.eval import prose, tasks
from lynxkv.eval.draft import greedy
from lynxkv.hf import prefill


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tasks")
    make_tiny_llama(5, vocab=256).save_pretrained(path)  # max_position_embeddings = 4096
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    (path / "a.txt").write_text(random_words(1, 1500), encoding="utf-8")
    (path / "b.md").write_text(random_words(2, 1500), encoding="utf-8")
    (path / "ignored.bin").write_bytes(b"\x00\x01")
    return str(path)


def test_parsers_and_the_wilson_interval():
    assert tasks.parse_tasks("all") == ("perplexity", "passkey")
    assert tasks.parse_tasks("passkey,perplexity,passkey") == ("perplexity", "passkey")
    assert tasks.parse_lengths("2K,1k,4096,1024") == (1024, 2048, 4096)
    assert tasks.parse_depths("1,0,0.5") == (0.0, 0.5, 1.0)
    for call, arg in ((tasks.parse_tasks, "needle"), (tasks.parse_lengths, "1M"), (tasks.parse_depths, "1.5")):
        with pytest.raises(InputError):
            call(arg)
    lo, hi = tasks.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = tasks.wilson(7, 10)
    assert lo == pytest.approx(0.3968, abs=1e-4) and hi == pytest.approx(0.8922, abs=1e-4)
    assert tasks.wilson(10, 10)[1] == 1.0


def test_task_codecs_put_the_original_first_and_know_the_exact_tier():
    assert [c.name for c in tasks.task_codecs(None)] == list(tasks.DEFAULT_CODECS)
    assert [c.name for c in tasks.task_codecs("kivi4, lynx-default-exact")] == ["fp32", "kivi4", "lynx-default-exact"]
    for bad, message in (("nope", "unknown codec 'nope'"), (" , ", "no codec named")):
        with pytest.raises(InputError, match=message):
            tasks.task_codecs(bad)


def test_passkey_prompt_holds_the_key_at_its_depth_and_exactly_the_length():
    tok = byte_tokenizer()
    filler = tok(random_words(3, 400)).input_ids
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = tasks.passkey_prompt(tok, filler, 600, depth, "31415")
        assert len(prompt) + len(answer) == 600
        text = tok.decode(prompt)
        assert tok.decode(answer) == " 31415" and text.endswith(tasks.QUESTION)
        assert text.startswith(tasks.INSTRUCTIONS)
        needle = tasks.NEEDLE.format(key="31415")
        before = text.index(needle) - len(tasks.INSTRUCTIONS)  # filler bytes (= tokens) before the needle
        after = len(text) - len(tasks.QUESTION) - text.index(needle) - len(needle)
        assert before / (before + after) == pytest.approx(depth, abs=0.01)
    with pytest.raises(InputError, match="cannot fill"):
        tasks.passkey_prompt(tok, filler[:100], 600, 0.5, "31415")


def test_greedy_decoding_is_transformers_own_and_leaves_the_cache_it_starts_from(tiny_model):
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (40,))
    kv, _ = prefill(tiny_model, ids[:-1])
    before = [(k.clone(), v.clone()) for k, v in kv]
    got = greedy(tiny_model, kv, int(ids[-1]), 12).tolist()
    with torch.no_grad():
        want = tiny_model.generate(ids.reshape(1, -1), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, ids.numel():].tolist()
    assert got == want
    assert all(torch.equal(k, bk) and torch.equal(v, bv) for (k, v), (bk, bv) in zip(kv, before))


def test_one_teacher_forced_forward_decides_what_greedy_decoding_emits(tiny_model):
    """The passkey check: all argmaxes of the answer fed in one forward equal the answer exactly when greedy
    decoding emits it."""
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (30,))
    kv, _ = prefill(tiny_model, ids[:-1])
    emitted = greedy(tiny_model, kv, int(ids[-1]), 5).tolist()
    for answer, expected in ((emitted, True), (emitted[:2] + [(emitted[2] + 1) % 128] + emitted[3:], False)):
        logits = tasks.forward_logits(tiny_model, kv, torch.tensor([int(ids[-1])] + answer[:-1]))
        assert (logits.argmax(-1).tolist() == answer) is expected


def test_perplexity_on_the_original_cache_is_the_models_own(tiny_model):
    """The cache path (prefill, store, teacher-forced forward) gives the loss one plain forward of the whole
    document gives; a coarse code moves it more than Lynx's full code."""
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (3 * 48,)).tolist()
    grid = tasks.Grid(tasks=("perplexity",), context=32, scored=16, documents=3)
    codecs = tasks.task_codecs("lynx-default,kivi2")
    res = tasks.run_perplexity(tiny_model, ids, grid, codecs)
    nll = 0.0
    for doc in tasks.documents(ids, grid):
        with torch.no_grad():
            logits = tiny_model(torch.tensor([doc])).logits[0].float()
        nll += float(torch.nn.functional.cross_entropy(logits[31:47], torch.tensor(doc[32:48]), reduction="sum"))
    c = res["codecs"]
    assert list(c) == ["fp32", "lynx-default", "kivi2"] and res["documents"] == 3
    assert c["fp32"]["ppl"] == pytest.approx(torch.tensor(nll / 48).exp().item(), rel=1e-4)
    assert c["fp32"]["ppl_delta"] == 0.0 and c["fp32"]["bits"] == 32.0
    assert abs(c["lynx-default"]["ppl_delta"]) < abs(c["kivi2"]["ppl_delta"])
    assert c["kivi2"]["ppl_delta_sem"] > 0.0


def test_clean_ids_cut_out_every_run_shared_with_the_choosing_corpus():
    from lynxkv.eval.cases import OVERLAP_TOKENS, choosing_runs
    from lynxkv.hf.prompts import corpus_sections

    tok = byte_tokenizer()
    borrowed = corpus_sections()[5][1][:400]  # a piece of the choosing corpus inside otherwise new text
    corpus = prose.TaskCorpus("mixed", random_words(5, 200) + " " + borrowed + " " + random_words(6, 200))
    avoid = choosing_runs(tok)
    ids, removed = prose.clean_ids(tok, corpus, avoid)
    assert removed >= 400 - 2 * OVERLAP_TOKENS
    assert all(hash(tuple(ids[i : i + OVERLAP_TOKENS])) not in avoid for i in range(len(ids) - OVERLAP_TOKENS + 1))
    assert tok.decode(ids).startswith(random_words(5, 200)[:100])


def test_default_corpus_is_prose_outside_both_other_corpora():
    from lynxkv.eval.cases import STDLIB_MODULES

    corpus = prose.default_corpus()
    assert not set(prose.PROSE_MODULES) & set(STDLIB_MODULES)
    assert len(corpus.text) > 200_000 and "docstrings" in corpus.name
    words = corpus.text.split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.6  # mostly words, not code


def test_cli_task_run_on_a_tiny_model(tiny_dir, words_dir, tmp_path, capsys):
    plots = tmp_path / "plots"
    rc = run_cli(["eval", "--task", "all", "--model", tiny_dir, "--corpus", words_dir, "--tokens", "96",
                  "--ppl-tokens", "16", "--prompts", "2", "--lengths", "320,384", "--depths", "0,1", "--trials", "2",
                  "--json", "--plot", str(plots)])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert "2 text file(s)" in result["corpus"] and "2 text file(s)" in captured.err
    assert list(result["codecs"]) == ["fp32", "lynx-default", "lynx-default-exact", "lynx-default-anchor",
                                      "int8-tensor", "int4-g64", "kivi4", "kivi2"]
    ppl, pk = result["perplexity"]["codecs"], result["passkey"]["codecs"]
    assert ppl["fp32"]["ppl_delta"] == 0.0 and ppl["kivi2"]["bits"] < ppl["lynx-default-anchor"]["bits"]
    assert pk["fp32"]["trials"] == 8 and [b["trials"] for b in pk["fp32"]["by_length"]] == [4, 4]
    assert all(len(s["cells"]) == 2 and len(s["cells"][0]) == 2 for s in pk.values())
    lo, hi = pk["kivi2"]["interval"]
    assert lo <= pk["kivi2"]["accuracy"] <= hi
    assert {t["target"].split(":")[0] for t in result["targets"]} == {"lynx full", "lynx anchor", "lynx exact tier"}
    exact = ppl["lynx-default-exact"]
    assert exact["nll_documents"] == ppl["fp32"]["nll_documents"] and pk["lynx-default-exact"]["cells"] == pk["fp32"][
        "cells"]
    assert ppl["lynx-default"]["bits"] < exact["bits"] < 32.0  # the full code plus a remainder, under the original
    assert [t["met"] for t in result["targets"] if t["target"].startswith("lynx exact")] == [True]
    for name in ("task_accuracy_vs_bits.png", "passkey_depth_length.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rc = run_cli(["eval", "--task", "perplexity", "--model", tiny_dir, "--corpus", words_dir, "--tokens", "96",
                  "--ppl-tokens", "16", "--prompts", "1", "--schemes", "kivi4"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.splitlines()  # piped: plain text, the original first
    assert lines[1].split()[:3] == ["codec", "bits/el", "PPL"] and lines[3].startswith("original (float32)")
    assert lines[4].startswith("kivi4") and "passkey" not in captured.out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "needle"], "--task: unknown task 'needle'"),
        (["--task", "passkey", "--lengths", "1K,8K"], "--lengths 8K: needs 8192 tokens but model"),
        (["--task", "perplexity", "--tokens", "4000", "--ppl-tokens", "256"], "needs 4256 tokens"),
        (["--task", "all", "--corpus", "EMPTY"], "holds no non-empty .txt, .md, .rst file"),
        (["--task", "all", "--corpus", "NOTEXT"], "holds no non-empty .txt, .md, .rst file"),
        (["--task", "all", "--corpus", "MISSING"], "is not a directory"),
        (["--task", "all", "--dtype", "fp16"], "--dtype: expected fp32 or bf16"),
        (["--task", "passkey", "--depths", "0,2"], "--depths: expected fractions between 0 and 1"),
        (["--task", "all", "--corpus", "choosing"], "tasks never read the choosing corpus"),
        (["--task", "all", "--kv", "x.safetensors"], "--task excludes --kv"),
    ],
    ids=["unknown-task", "context-too-short", "ppl-context-too-short", "empty-corpus", "no-text-file-corpus",
         "missing-corpus", "dtype", "depth", "choosing", "kv"],
)
def test_bad_task_input_is_one_line_before_any_model_is_loaded(args, message, tiny_dir, tmp_path, capsys,
                                                               monkeypatch):
    import lynxkv.hf.models

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n", encoding="utf-8")
    notext = tmp_path / "notext"
    notext.mkdir()
    (notext / "words.bin").write_text(random_words(7, 400), encoding="utf-8")  # text, but not a suffix read
    monkeypatch.setattr(lynxkv.hf.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    named = {"EMPTY": str(empty), "NOTEXT": str(notext), "MISSING": str(tmp_path / "missing")}
    args = [named.get(a, a) for a in args]
    assert run_cli(["eval", "--model", tiny_dir, *args]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("lynxkv: error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_smollm2_finds_the_key_and_lynx_full_keeps_its_perplexity(smollm2):
    """On the real model and the default text: the original cache and Lynx's full code both retrieve keys the
    model finds, and the full code's perplexity stays within 0.1% of the original's (the anchor's and KIVI-2's
    move further)."""
    ids, _ = prose.clean_ids(smollm2.tokenizer, prose.default_corpus())
    grid = tasks.Grid(context=256, scored=64, documents=2, lengths=(320,), depths=(0.0, 0.5), trials=1)
    codecs = tasks.task_codecs("lynx-default,lynx-default-anchor,kivi2")
    ppl = tasks.run_perplexity(smollm2.model, ids, grid, codecs)["codecs"]
    assert abs(ppl["lynx-default"]["ppl_delta"]) < 1e-3
    assert abs(ppl["lynx-default"]["ppl_delta"]) < abs(ppl["lynx-default-anchor"]["ppl_delta"])
    assert ppl["kivi2"]["ppl_delta"] > 0.01
    pk = tasks.run_passkey(smollm2.model, smollm2.tokenizer, ids, grid, codecs)["codecs"]
    assert pk["fp32"]["hits"] == 2 and pk["lynx-default"]["cells"] == pk["fp32"]["cells"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_row_feeds_the_model_its_own_kv_through_the_code_in_the_models_dtype(dtype, monkeypatch):
    """A fair comparison in either dtype: the original row's forward reads the KV the model itself produced, bit
    for bit, and Lynx's row reads that KV through the full code decoded straight to the model's dtype (what
    ``dequantize(..., dtype=)`` gives a decoder of that cache), both as the same kind of cache; the exact tier's
    row reads the model's own KV again (through save_cache and load_kv)."""
    import lynxkv.eval.draft
    from lynxkv.quant import dequantize, quantize
    from lynxkv.quant.scheme import get_scheme

    model = make_tiny_llama(6).to(dtype)
    torch.manual_seed(6)
    ids = torch.randint(0, 128, (48,)).tolist()
    grid = tasks.Grid(tasks=("perplexity",), context=32, scored=16, documents=1)
    read: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    real_forward = lynxkv.eval.draft.forward

    def spy(model, input_ids, cache):
        read.append([(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers])
        return real_forward(model, input_ids, cache)

    monkeypatch.setattr(lynxkv.eval.draft, "forward", spy)
    tasks.run_perplexity(model, ids, grid, tasks.task_codecs("lynx-default,lynx-default-exact"))
    monkeypatch.undo()
    own, _ = prefill(model, torch.tensor(ids[:31]))
    scheme = get_scheme("default")
    decoded = [(dequantize(quantize(k, scheme, "key"), scheme, dtype=dtype),
                dequantize(quantize(v, scheme, "value"), scheme, dtype=dtype)) for k, v in own]
    assert len(read) == 3  # the original, Lynx's full code, the full code with the exact tier
    for seen, expected in zip(read, (own, decoded, own)):
        assert len(seen) == len(expected)
        for (k, v), (ek, ev) in zip(seen, expected):
            assert k.dtype == v.dtype == dtype
            assert torch.equal(k, ek) and torch.equal(v, ev)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(own, decoded))  # the code did change the cache
