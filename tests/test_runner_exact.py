"""``lynxkv run --exact``: the drafts are verified against the exact segment, so the output is greedy
decoding on the original cache, per dtype, on a tiny model through the CLI and the progressive reader."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama
from lynxkv.cache import save_cache
from lynxkv.cache.kv import TORCH_DTYPES
from lynxkv.cli import main
from lynxkv.hf import prefill
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import decode_plain
from lynxkv.stream.exact_load import ExactLoad
from lynxkv.stream.progressive import open_progressive
from runner_helpers import prompt_ids, save_tiny_model_dir, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(scope="module", params=list(TORCH_DTYPES))
def tiny(request, tmp_path_factory):
    """A tiny Llama in ``dtype``, its prefill of a 200-token prompt stored with an exact segment."""
    dtype = TORCH_DTYPES[request.param]
    d = tmp_path_factory.mktemp(f"exact-{request.param}")
    model = make_tiny_llama(5, layers=2, head_dim=32).to(dtype)
    model_dir = save_tiny_model_dir(model, d / "model")
    ids = prompt_ids(5, 200)
    kv, _ = prefill(model, torch.tensor(ids))
    assert kv[0][0].dtype == dtype
    path = d / "c.lynx"
    save_cache(path, kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model), exact=True)
    return request.param, model, model_dir, str(path), ids, kv


def _run(capsys, *args):
    code = main(["run", *map(str, args)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _same_bits(a, b) -> bool:
    return all(torch.equal(x.view(INT_VIEW[x.dtype]), y.view(INT_VIEW[y.dtype]))
               for (xk, xv), (yk, yv) in zip(a, b) for x, y in ((xk, yk), (xv, yv)))


def test_exact_load_delivers_the_anchor_then_the_original_tensors(tiny):
    _, _, _, path, _, kv = tiny
    from lynxkv.cache import open_cache

    def read_exact():
        with open_cache(path) as c:
            return c.load_kv(exact=True)

    load = ExactLoad(open_progressive(path), read_exact)
    try:
        with open_cache(path) as c:
            anchor = load.wait_anchor()  # the progressive reader's own dtype
            assert _same_bits(anchor, c.load_kv(anchor_only=True, dtype=anchor[0][0].dtype))
            full = c.load_kv()
        got = load.residual.result(timeout=60)
        assert _same_bits(got, kv) and not _same_bits(full, kv)
        assert load.timeline.extra["exact_ready_s"] >= load.timeline.residual_ready_s
    finally:
        load.close()


def test_run_exact_equals_greedy_decoding_on_the_original_cache(tiny, capsys):
    name, model, model_dir, path, ids, kv = tiny
    code, out, err = _run(capsys, path, "--model", model_dir, "--dtype", name, "-n", "12", "--ignore-eos",
                          "--exact", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["verified"] is True and doc["verified_against"] == "exact"
    assert "exact_ready_s" in doc["stats"]["load"]["extra"]
    want = decode_plain(model, kv, ids, 12, first_forward=doc["stats"]["draft_token_ids"])
    assert doc["token_ids"] == want


def test_run_exact_refuses_a_corrupt_exact_file_and_a_cache_without_one(tiny, capsys, tmp_path):
    name, model, model_dir, path, ids, kv = tiny
    import shutil

    shutil.copy(path, tmp_path / "c.lynx")
    shutil.copy(path.replace(".lynx", ".lynxr"), tmp_path / "c.lynxr")
    data = bytearray(open(path.replace(".lynx", ".lynxe"), "rb").read())
    data[-1] ^= 0x10
    (tmp_path / "c.lynxe").write_bytes(bytes(data))
    code, out, err = _run(capsys, tmp_path / "c.lynx", "--model", model_dir, "--dtype", name, "-n", "4",
                          "--exact", "--json")
    lines = [ln for ln in err.splitlines() if ln.startswith("lynxkv: error:")]
    assert code == 1 and len(lines) == 1 and "exact" in lines[0] and "Traceback" not in err, err
    assert out == ""
    save_cache(tmp_path / "plain.lynx", kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    code, _, err = _run(capsys, tmp_path / "plain.lynx", "--model", model_dir, "--exact")
    assert code == 1 and "no exact segment" in err
