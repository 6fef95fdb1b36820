"""The scripts in examples/ run end to end at small sizes (a tiny model saved as a Hugging Face directory)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from conftest import make_tiny_llama
from lynxkv.hf import prefill
from lynxkv.hf.models import encode_prompt, load_model
from lynxkv.hf.prompts import builtin_prompt
from lynxkv.speculative import decode_plain
from lynxkv.bench.simulated import split_kv
from lynxkv.quant.scheme import get_scheme
from runner_helpers import save_tiny_model_dir, single_thread, text_of

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(make_tiny_llama(6, layers=2, head_dim=32), tmp_path_factory.mktemp("ex") / "m")


def test_stream_tokens_example(model_dir, capsys):
    tokens = _load("stream_tokens").main(["--model", model_dir, "--tokens", "80", "-n", "12",
                                          "--residual-ms", "30"])
    out = capsys.readouterr().out
    loaded = load_model(model_dir)
    ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, 80))
    kv, _ = prefill(loaded.model, ids)
    _, full_kv = split_kv(kv, get_scheme())
    want = decode_plain(loaded.model, full_kv, ids.tolist(), 12, stop_token_ids=())
    assert tokens == want
    assert "commit" in out and "done: 12 tokens" in out


def test_pipeline_example(model_dir, tmp_path, capsys):
    res = _load("lynx_pipeline").main(["--model", model_dir, "--tokens", "120", "-n", "16", "--anchor-bits", "5",
                                       "--residual-steps", "10", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["monolithic-full"]["same_tokens_as_lynx"]
    assert os.path.exists(tmp_path / "fast" / "cache.lynx") and os.path.exists(tmp_path / "slow" / "cache.lynxr")
    assert res["stats"]["committed"] == 16 and "monolithic-bf16" in out


def test_document_questions_example(model_dir, tmp_path, capsys):
    from lynxkv import open_cache

    answers = _load("document_questions").main(["--model", model_dir, "--tokens", "60", "-n", "8", "--dir",
                                                str(tmp_path), "--question", " " + text_of([5, 6]),
                                                "--question", " " + text_of([7, 8, 9])])
    loaded = load_model(model_dir)
    with open_cache(tmp_path / "doc.lynx") as cache:
        ids, full_kv = cache.info.prompt_token_ids, cache.load_kv()
    assert [a["new_token_ids"] for a in answers] == [[5, 6], [7, 8, 9]]
    for a in answers:
        assert a["token_ids"] == decode_plain(loaded.model, full_kv, ids, 8, new_token_ids=a["new_token_ids"],
                                              first_forward=a["draft_token_ids"])
        assert 0 < len(a["generate_token_ids"]) <= 8  # generate stops at the tokenizer's end-of-sequence
