"""The model matrix: tiny random configs of seven architectures × {fp32, bf16, fp16}.

Each combination goes encode → inspect → verify → run → run with a new question, through the Python API and
through the CLI, and the greedy output must equal plain greedy decoding on the decoded full code in the same
dtype (:func:`lynxkv.speculative.decode_plain` with the forward shape of the run's verify pass: in bf16 and fp16
one multi-token forward and single steps round differently, see its docstring). Mistral, Qwen3 (``layer_types``),
Gemma 2 and Gemma 3 have sliding windows shorter than the prompt.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import SLIDING_WINDOW, TINY_ARCHS, make_tiny_model
from lynxkv.cache import open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.hf import prefill
from lynxkv.hf.models import model_fingerprint
from lynxkv.cache.kv import TORCH_DTYPES
from lynxkv.speculative import RunConfig, decode_plain, run
from runner_helpers import StepLoad, prompt_ids, save_tiny_model_dir, single_thread, text_of

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

PROMPT = 4 * SLIDING_WINDOW  # every windowed layer really drops tokens in a transformers sliding cache
NEW = 12


@pytest.fixture(scope="module")
def models():
    return {(arch, dt): make_tiny_model(arch).to(TORCH_DTYPES[dt]) for arch in TINY_ARCHS
            for dt in TORCH_DTYPES}


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_run_and_continue_equal_plain_decoding(models, tmp_path, arch, dtype):
    model = models[(arch, dtype)]
    ids = prompt_ids(3, PROMPT)
    kv, _ = prefill(model, torch.tensor(ids))
    assert all(k.shape[1] == PROMPT and k.dtype == model.dtype for k, _ in kv)
    info = save_cache(tmp_path / "x.lynx", kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    assert (info.dtype, info.tokens) == (dtype, PROMPT)
    assert verify_file(tmp_path / "x.lynx") == []
    with open_cache(tmp_path / "x.lynx") as cache:
        full_kv, anchor_kv = cache.load_kv(), cache.load_kv(anchor_only=True)

    # continue the cached prompt; then a new question after it
    for new in (None, prompt_ids(4, 5)):
        res = run(model, StepLoad(model, ids, anchor_kv, full_kv), RunConfig(max_new_tokens=NEW, max_window=6),
                  new_token_ids=new)
        assert res.stats.drafted == 6 and res.stats.prompt_tokens == PROMPT + len(new or [])
        want = decode_plain(model, full_kv, ids, NEW, new_token_ids=new, first_forward=res.stats.draft_token_ids,
                            branch=(res.stats.branch_at, res.stats.branch_token_ids))
        assert res.token_ids == want
        if dtype == "fp32":  # in fp32 the forward shape does not matter: plain sequential decoding agrees
            assert res.token_ids == decode_plain(model, full_kv, ids, NEW, new_token_ids=new)
        if new:  # and independently: the decoded full cache, the question, then one token per forward
            assert res.token_ids == _greedy_after(model, full_kv, new, res.stats.draft_token_ids)


def _greedy_after(model, kv, question: list[int], drafts: list[int]) -> list[int]:
    """Greedy decoding on a DynamicCache of all of ``kv`` after ``question``, written without lynxkv's runner
    code; its first forward appends ``drafts`` (the verify pass's shape, which matters in bf16/fp16 only)."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv])
    with torch.no_grad():
        rows = model(input_ids=torch.tensor([question + drafts]), cache=cache).logits[0, len(question) - 1:]
        best = rows.float().argmax(-1).tolist()
        n = next((i for i, d in enumerate(drafts) if best[i] != d), len(drafts))
        out = best[: n + 1]
        cache.crop(-(len(drafts) - n)) if len(drafts) > n else None
        while len(out) < NEW:
            logits = model(input_ids=torch.tensor([out[-1:]]), cache=cache).logits[0, -1]
            out.append(int(logits.float().argmax()))
    return out[:NEW]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_plain_decoding_on_the_stored_cache_equals_transformers_generate(arch):
    """The runner's full-length cache gives the model's own attention (windows applied by the mask): greedy
    decoding on the exact prefill equals ``generate`` over the whole prompt with transformers' own cache."""
    model = make_tiny_model(arch)
    ids, new = prompt_ids(5, PROMPT), prompt_ids(6, 4)
    kv, _ = prefill(model, torch.tensor(ids))
    with torch.no_grad():
        want = model.generate(torch.tensor([ids + new]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, PROMPT + len(new):].tolist()
    assert decode_plain(model, kv, ids, NEW, new_token_ids=new) == want


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: save_tiny_model_dir(make_tiny_model(arch), root / arch) for arch in TINY_ARCHS}


def _cli(capsys, argv: list[str]):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cli_encode_inspect_verify_run_continue(model_dirs, tmp_path, capsys, arch, dtype):
    if arch == "qwen2":
        pytest.skip("transformers 5 always loads Qwen2's own byte-level tokenizer class, which cannot read the "
                    "test's word-level vocabulary (the Python API matrix covers Qwen2)")
    path, ids = model_dirs[arch], prompt_ids(7, PROMPT)
    (tmp_path / "p.txt").write_text(text_of(ids))
    x = str(tmp_path / "x.lynx")
    _cli(capsys, ["encode", "--model", path, "--prompt-file", str(tmp_path / "p.txt"), "--dtype", dtype, "-o", x])
    d = json.loads(_cli(capsys, ["inspect", x, "--json"]))
    assert (d["dtype"], d["tokens"], d["prompt_token_ids"]) == (dtype, PROMPT, ids)
    _cli(capsys, ["verify", x])

    from lynxkv.hf.models import load_model

    model = load_model(path, dtype=TORCH_DTYPES[dtype]).model
    with open_cache(x) as cache:
        full_kv = cache.load_kv()
    for extra, new in (([], []), (["--prompt", " " + text_of([9, 8, 7])], [9, 8, 7])):
        report = json.loads(_cli(capsys, ["run", x, "--model", path, "--dtype", dtype, "-n", str(NEW), "--json",
                                          "--ignore-eos", *extra]))
        assert report["prompt_token_ids"] == ids + new
        drafts = report["stats"]["draft_token_ids"]
        assert report["token_ids"] == decode_plain(model, full_kv, ids, NEW, new_token_ids=new, first_forward=drafts)
