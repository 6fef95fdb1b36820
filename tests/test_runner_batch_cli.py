"""``lynxkv run A B C`` and ``lynxkv run requests.jsonl``: one batch over one emulated link, through the
progressive reader; every request's tokens equal decoding on its own full code; one bad residual ends only its
request."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import make_tiny_llama
from lynxkv.cache import save_cache
from lynxkv.cli import main
from lynxkv.hf import prefill
from lynxkv.hf.models import model_fingerprint
from lynxkv.quant.scheme import get_scheme
from lynxkv.speculative import decode_plain
from lynxkv.bench.simulated import split_kv
from runner_helpers import prompt_ids, save_tiny_model_dir, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

LENGTHS = (40, 120, 70, 200, 90, 30, 160, 55)


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("batchcli")
    model = make_tiny_llama(4, layers=3, head_dim=32)
    model_dir = save_tiny_model_dir(model, d / "model")
    paths, refs = [], []
    for i, n in enumerate(LENGTHS):
        ids = prompt_ids(10 + i, n)
        kv, _ = prefill(model, torch.tensor(ids))
        path = d / f"c{i}.lynx"
        save_cache(path, kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
        paths.append(str(path))
        refs.append((ids, split_kv(kv, get_scheme())[1]))
    return model, model_dir, paths, refs, d


def _run(capsys, *args):
    code = main(["run", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _check_tokens(model, refs, doc, n):
    for (ids, full), r in zip(refs, doc["requests"]):
        want = decode_plain(model, full, ids, n, first_forward=r["stats"]["draft_token_ids"],
                            branch=(r["stats"]["branch_at"], r["stats"]["branch_token_ids"]))
        assert r["token_ids"] == want, r["name"]


def test_several_caches_json(batch_dir, capsys):
    model, model_dir, paths, refs, _ = batch_dir
    order, turn = "srf", "cache"
    code, out, err = _run(capsys, *paths, "--model", model_dir, "-n", "16", "--ignore-eos", "--bandwidth", "4MB/s",
                          "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [r["cache"] for r in doc["requests"]] == paths  # in the order given
    _check_tokens(model, refs, doc, 16)
    for r in doc["requests"]:  # each request's usual run --json object
        assert {"token_ids", "text", "verified", "stats", "prompt_token_ids"} <= set(r) and r["verified"]
        assert r["stats"]["committed"] == 16 and r["stats"]["anchor_ready_s"] <= r["stats"]["residual_ready_s"]
    agg = doc["aggregate"]
    assert agg["requests"] == 8 and agg["tokens"] == 8 * 16 and agg["max_batch"] > 1 and agg["link_order"] == order
    assert agg["link_turn"] == turn
    # the residuals took the link one at a time, fewest bytes first
    sizes = [r["stats"]["load"]["residual_bytes"] for r in doc["requests"]]
    expect = list(range(8)) if order == "fifo" else sorted(range(8), key=lambda i: (sizes[i], i))
    sent = [int(name.split(":")[0]) for name in agg["residuals_sent_in_order"]]
    assert sent == expect


def test_request_file_table_and_plot(batch_dir, capsys, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import lynxkv.cli.run_batch as many
    model, model_dir, paths, refs, d = batch_dir
    lines = [{"cache": os.path.basename(p), "max_new_tokens": 8 + 2 * i, "arrival_s": 0.05 * i, "name": f"q{i}"}
             for i, p in enumerate(paths)]
    req = d / "requests.jsonl"
    req.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    png = tmp_path / "tokens.png"
    shown = io.StringIO()  # a wide console of its own: the shared one's width depends on the terminal
    monkeypatch.setattr(many, "out", Console(file=shown, width=300))
    code, _, err = _run(capsys, str(req), "--model", model_dir, "--ignore-eos", "--bandwidth", "8MB/s",
                        "--timeline", str(png), "--compare")
    assert code == 0, err
    out = shown.getvalue()
    for i in range(8):
        assert f"q{i}" in out
    assert "aggregate:" in out and "tokens/s" in out and "TT64 monolithic" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = _run(capsys, str(req), "--model", model_dir, "--ignore-eos", "--bandwidth", "8MB/s", "--json",
                          "--compare")
    doc = json.loads(out)
    for i, ((ids, full), r) in enumerate(zip(refs, doc["requests"])):
        assert r["arrival_s"] == pytest.approx(0.05 * i)
        assert r["token_ids"] == decode_plain(model, full, ids, 8 + 2 * i, first_forward=r["stats"]["draft_token_ids"])
        assert r["compare"]["monolithic_full"]["same_tokens_as_lynx"] is True


def test_staggered_requests_keep_only_the_open_ones_loaded(batch_dir, capsys, monkeypatch):
    """Eight requests arriving one after another, at most three open at once: at every step no more than three
    loads exist, so a request that has left holds nothing (its load and KV are freed as it leaves, by reference
    counts alone: the cyclic garbage collector is off, as it may not run for a long time in a real batch)."""
    import gc

    import lynxkv.cli.run_batch as many
    from lynxkv.stream import progressive

    model, model_dir, paths, refs, d = batch_dir
    req = d / "staggered.jsonl"
    req.write_text("\n".join(json.dumps({"cache": os.path.basename(p), "arrival_s": 0.02 * i, "name": str(i)})
                             for i, p in enumerate(paths)) + "\n")
    live = []
    monkeypatch.setattr(many._Progress, "update", lambda self, results: live.append(len(progressive._LIVE)))
    gc.collect()
    gc.disable()
    try:
        code, out, err = _run(capsys, str(req), "--model", model_dir, "-n", "6", "--ignore-eos", "--bandwidth",
                              "8MB/s", "--max-batch", "3", "--json")
    finally:
        gc.enable()
    assert code == 0, err
    doc = json.loads(out)
    _check_tokens(model, refs, doc, 6)
    assert len(live) == doc["aggregate"]["steps"] and max(live) <= 3
    assert len(progressive._LIVE) == 0


@pytest.mark.parametrize("fault", ["missing", "corrupt", "foreign"])
@pytest.mark.parametrize("anchor_only", [False, True], ids=["error", "anchor-only"])
def test_one_bad_residual_ends_only_its_request(batch_dir, capsys, tmp_path, fault, anchor_only):
    model, model_dir, paths, refs, _ = batch_dir
    mine = []
    for i, p in enumerate(paths[:4]):
        for suffix in ("", "r"):
            shutil.copy(p + suffix, tmp_path / f"c{i}.lynx{suffix}")
        mine.append(str(tmp_path / f"c{i}.lynx"))
    bad = tmp_path / "c1.lynxr"
    if fault == "missing":
        bad.unlink()
    elif fault == "corrupt":
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a page's codes: its CRC no longer matches
        bad.write_bytes(bytes(data))
    else:  # another cache's residual under this one's name
        shutil.copy(tmp_path / "c2.lynxr", bad)
    args = [*mine, "--model", model_dir, "-n", "12", "--ignore-eos", "--bandwidth", "8MB/s", "--json"]
    code, out, err = _run(capsys, *args, *(["--allow-anchor-only"] if anchor_only else []))
    doc = json.loads(out)
    r1 = doc["requests"][1]
    if anchor_only:
        assert code == 0, err
        assert r1["error"] is None and r1["verified"] is False and r1["stats"]["residual_error"]
    else:
        assert code == 1
        assert r1["error"] and r1["token_ids"] == []
        assert err.count("lynxkv: error:") == 1 and "request 1:" in err
    _check_tokens(model, [refs[0]], {"requests": [doc["requests"][0]]}, 12)
    _check_tokens(model, refs[2:4], {"requests": doc["requests"][2:4]}, 12)
    assert all(doc["requests"][i]["verified"] for i in (0, 2, 3))


@pytest.mark.parametrize("line, message", [
    ('{"cache": "c0.lynx", "tokens": 3}', "unknown key"),
    ('{"max_new_tokens": 3}', '"cache"'),
    ('not json', "not JSON"),
    ('{"cache": "c0.lynx", "max_new_tokens": "many"}', "wrong type"),
], ids=["unknown-key", "no-cache", "not-json", "wrong-type"])
def test_bad_request_file(batch_dir, capsys, line, message):
    _, model_dir, _, _, d = batch_dir
    req = d / "bad.jsonl"
    req.write_text(line + "\n")
    code, out, err = _run(capsys, str(req), "--model", model_dir)
    assert code == 1 and "lynxkv: error:" in err and message in err and "line 1" in err


@pytest.mark.parametrize("option", ["--residual"])
def test_one_cache_options_are_refused_with_several(batch_dir, capsys, option):
    _, model_dir, paths, _, _ = batch_dir
    code, out, err = _run(capsys, *paths[:2], "--model", model_dir, option, paths[0] + "r")
    assert code == 1 and option in err and err.count("\n") == 1


def _copies(paths, tmp_path, n):
    out = []
    for i, p in enumerate(paths[:n]):
        for suffix in ("", "r"):
            shutil.copy(p + suffix, tmp_path / f"c{i}.lynx{suffix}")
        out.append(str(tmp_path / f"c{i}.lynx"))
    return out


@pytest.mark.parametrize("fault", ["truncated", "missing", "not-a-cache", "directory"])
def test_one_bad_cache_ends_only_its_request(batch_dir, capsys, tmp_path, fault):
    """An anchor that cannot be opened (cut short, missing, not a .lynx file, a directory) ends only its request,
    with an error that names it; the others decode as usual."""
    model, model_dir, paths, refs, _ = batch_dir
    mine = _copies(paths, tmp_path, 3)
    bad = tmp_path / "c1.lynx"
    if fault == "truncated":
        bad.write_bytes(bad.read_bytes()[:5000])
    elif fault == "missing":
        bad.unlink()
    elif fault == "not-a-cache":
        bad.write_bytes(b"not a cache" * 100)
    else:
        bad.unlink()
        bad.mkdir()
    code, out, err = _run(capsys, *mine, "--model", model_dir, "-n", "8", "--ignore-eos", "--json")
    assert code == 1 and "Traceback" not in err
    doc = json.loads(out)
    assert doc["requests"][1]["error"] and doc["requests"][1]["token_ids"] == []
    assert err.count("lynxkv: error:") == 1 and "request 1:c1.lynx:" in err and "c1.lynx" in err.split(":", 3)[-1]
    _check_tokens(model, [refs[0], refs[2]], {"requests": [doc["requests"][0], doc["requests"][2]]}, 8)


def test_names_and_errors_are_printed_as_text_not_markup(batch_dir, capsys, tmp_path):
    """A request's name and its error come from files: printed as they are (rich markup in them is not
    interpreted, so it can neither fail the output nor hide text), in the table and in the error lines."""
    _, model_dir, paths, _, _ = batch_dir
    mine = _copies(paths, tmp_path, 2)
    (tmp_path / "c1.lynx").write_bytes(b"[/] [bold red]x[/bold red]")
    req = tmp_path / "r.jsonl"
    req.write_text(json.dumps({"cache": mine[0], "name": "[bold red]HIDDEN[/bold red] a"}) + "\n"
                   + json.dumps({"cache": mine[1], "name": "[/]"}) + "\n")
    code, out, err = _run(capsys, str(req), "--model", model_dir, "-n", "4", "--ignore-eos")
    assert code == 1 and "Traceback" not in err
    assert "[bold red]" in out  # the table's row, as written (its cell may be cut to the table's width)
    assert "lynxkv: error: request [/]:" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("line, message", [
    ('{"cache": "c0.lynx", "arrival_s": NaN}', "finite"),
    ('{"cache": "c0.lynx", "arrival_s": Infinity}', "finite"),
    ('{"cache": "c0.lynx", "temperature": Infinity}', "finite"),
    ('{"cache": "c0.lynx", "name": "\\ud800"}', "not valid text"),
    ('{"cache": "c0.lynx\\u0000x"}', "not valid text"),
    ('{"cache": ""}', '"cache"'),
    ('{"cache": "c0.lynx", "name": "a"}\n{"cache": "c1.lynx", "name": "a"}', "already in the file"),
], ids=["nan-arrival", "inf-arrival", "inf-temperature", "surrogate", "nul", "empty-cache", "same-name"])
def test_bad_request_values(batch_dir, capsys, line, message):
    _, model_dir, _, _, d = batch_dir
    req = d / "bad.jsonl"
    req.write_text(line + "\n")
    code, out, err = _run(capsys, str(req), "--model", model_dir)
    assert code == 1 and out == "" and message in err and "line " in err and len(err.strip().splitlines()) == 1


def test_a_request_file_with_a_bom_and_nulls_takes_the_defaults(batch_dir, capsys):
    """A byte-order mark (as some editors write) is not part of the first line; a key given as null takes the
    command's default."""
    model, model_dir, paths, refs, d = batch_dir
    req = d / "bom.jsonl"
    req.write_bytes("\ufeff".encode() + (json.dumps({"cache": paths[0], "max_new_tokens": None, "seed": None,
                                                     "name": None}) + "\n").encode())
    code, out, err = _run(capsys, str(req), "--model", model_dir, "-n", "5", "--ignore-eos", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["requests"][0]["name"] == f"0:{os.path.basename(paths[0])}"
    _check_tokens(model, refs[:1], doc, 5)


def test_a_request_file_larger_than_any_prompt_is_refused(batch_dir, capsys, monkeypatch):
    from lynxkv.cli import console

    _, model_dir, paths, _, d = batch_dir
    monkeypatch.setattr(console, "TEXT_LIMIT", 100)
    req = d / "big.jsonl"
    req.write_text(json.dumps({"cache": paths[0], "prompt": "w" * 200}) + "\n")
    code, out, err = _run(capsys, str(req), "--model", model_dir)
    assert code == 1 and "more than 100 bytes" in err


def test_a_request_past_the_models_context_ends_alone(batch_dir, capsys):
    """A request whose prompt and new tokens need more positions than the model has ends with that error before
    any of its forwards (a long prompt would otherwise build a mask of its length squared); the others go on."""
    model, model_dir, paths, refs, d = batch_dir
    context = model.config.max_position_embeddings
    req = d / "long.jsonl"
    req.write_text(json.dumps({"cache": paths[0]}) + "\n"
                   + json.dumps({"cache": paths[1], "max_new_tokens": context}) + "\n")
    code, out, err = _run(capsys, str(req), "--model", model_dir, "-n", "6", "--ignore-eos", "--json")
    assert code == 1
    doc = json.loads(out)
    assert f"the model has {context}" in doc["requests"][1]["error"] and doc["requests"][1]["token_ids"] == []
    _check_tokens(model, refs[:1], {"requests": doc["requests"][:1]}, 6)
    code, _, err = main(["run", paths[1], "--model", model_dir, "-n", str(context)]), None, capsys.readouterr().err
    assert code == 1 and f"the model has {context}" in err


def test_the_results_are_printed_before_a_timeline_that_cannot_be_written(batch_dir, capsys, tmp_path,
                                                                         monkeypatch):
    import lynxkv.storage
    from lynxkv.errors import InputError

    model, model_dir, paths, refs, _ = batch_dir

    def full(path, data):
        raise InputError(f"{path}: no space left on the device; nothing was written")

    monkeypatch.setattr(lynxkv.storage, "write_atomic", full)
    code, out, err = _run(capsys, *paths[:2], "--model", model_dir, "-n", "4", "--ignore-eos", "--json",
                          "--timeline", str(tmp_path / "t.png"))
    assert code == 1 and "no space left" in err
    _check_tokens(model, refs[:2], json.loads(out), 4)


def test_compare_does_not_call_two_failures_the_same_tokens(batch_dir, capsys, tmp_path):
    _, model_dir, paths, _, _ = batch_dir
    mine = _copies(paths, tmp_path, 2)
    (tmp_path / "c1.lynxr").unlink()
    code, out, err = _run(capsys, *mine, "--model", model_dir, "-n", "4", "--ignore-eos", "--json", "--compare")
    doc = json.loads(out)
    assert code == 1 and doc["requests"][1]["compare"]["monolithic_full"]["same_tokens_as_lynx"] is None
    assert doc["requests"][0]["compare"]["monolithic_full"]["same_tokens_as_lynx"] is True


@pytest.mark.parametrize("flag", ["--anchor-timeout", "--residual-timeout"])
@pytest.mark.parametrize("value", ["nan", "-1", "0"])
def test_a_timeout_must_be_a_positive_number(batch_dir, capsys, flag, value):
    _, model_dir, paths, _, _ = batch_dir
    code, out, err = _run(capsys, paths[0], "--model", model_dir, flag, value)
    assert code == 1 and flag in err


def test_allow_location_lets_run_read_a_residual_on_another_tier(batch_dir, capsys, tmp_path):
    """A residual recorded outside the anchor's folder is refused unless the user allows its place, with
    --allow-location as for the other commands (or $LYNXKV_ALLOW_LOCATIONS)."""
    from lynxkv.stream.tier import move_cache

    model, model_dir, paths, refs, _ = batch_dir
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    hot.mkdir(), cold.mkdir()
    mine = _copies(paths, hot, 1)[0]
    move_cache(mine, residual_to=str(cold / "c0.lynxr"))
    code, out, err = _run(capsys, mine, "--model", model_dir, "-n", "4", "--ignore-eos", "--json")
    assert code == 1 and "--allow-location" in err
    for args in ([mine], [mine, mine]):
        code, out, err = _run(capsys, *args, "--model", model_dir, "-n", "4", "--ignore-eos", "--json",
                              "--allow-location", str(cold))
        assert code == 0, err
        doc = json.loads(out)
        _check_tokens(model, refs[:1] * len(args), doc if "requests" in doc else {"requests": [doc]}, 4)
