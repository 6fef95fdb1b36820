"""The run's timeline (``lynxkv run --timeline``, ``--json``'s ``timelines``): every event recorded, the PNG drawn."""

from __future__ import annotations

import json

import pytest

from lynxkv.cli import main
from runner_helpers import single_thread, tiny_llama_cache

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

PNG = b"\x89PNG\r\n\x1a\n"
# The tiny cache's residual (58 KB) takes about 58 ms at 1 MB/s: room for a few draft steps even on a loaded
# machine (4 MB/s left 15 ms, sometimes less than one step). At most 8 drafts, so plain steps follow the verify.
WINDOW = ("--bandwidth", "1MB/s", "--max-window", "8")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("timeline")
    _, model_dir, path, _, _ = tiny_llama_cache(d)
    return model_dir, path, d


def _run(capsys, *args):
    code = main(["run", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _check_lynx(tl, n):
    assert tl["method"] == "lynx"
    assert tl["anchor_ready_s"] < tl["residual_ready_s"]
    # three layers of residual, each noted once, in layer order, as its last byte arrived (before it was ready)
    assert [r["layer"] for r in tl["residual_layers"]] == [0, 1, 2]
    arrived = [r["arrived_s"] for r in tl["residual_layers"]]
    assert arrived == sorted(arrived) and tl["anchor_ready_s"] <= arrived[0] and arrived[-1] <= tl["residual_ready_s"]
    got = [r["bytes"] for r in tl["residual_layers"]]
    assert got == sorted(got) and got[0] > 0
    # the draft forwards run on the anchor, between it and the verify; one per draft
    assert len(tl["draft_steps"]) == tl["drafted"] > 0
    assert all(tl["anchor_ready_s"] <= s <= e for s, e in tl["draft_steps"])
    v0, v1 = tl["verify"]
    assert tl["draft_steps"][-1][1] <= v0 < v1
    if tl["verify_layered"]:  # the verify ran while the last layers arrived, and ended after the last one
        assert v0 < tl["residual_ready_s"] <= v1
    else:
        assert v0 >= tl["residual_ready_s"]
    # every committed token, in order, none before the verify ended; the plain steps after it
    assert len(tl["tokens_s"]) == n and tl["tokens_s"] == sorted(tl["tokens_s"]) and tl["tokens_s"][0] >= v1
    assert len(tl["decode_steps"]) == max(0, n - tl["accepted"] - 1)  # none when every token was a kept draft
    assert all(v1 <= s <= e for s, e, _ in tl["decode_steps"])


def test_run_records_a_timeline_and_draws_it(tiny_cache, capsys, tmp_path):
    model_dir, path, _ = tiny_cache
    png = tmp_path / "t.png"
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "20", "--ignore-eos", *WINDOW,
                          "--timeline", str(png), "--json")
    assert code == 0, err
    doc = json.loads(out)
    [tl] = doc["timelines"]
    _check_lynx(tl, 20)
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]  # no temporary file left beside it


def test_compare_records_one_timeline_per_method(tiny_cache, capsys, tmp_path):
    model_dir, path, _ = tiny_cache
    png = tmp_path / "c.png"
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "16", "--ignore-eos", *WINDOW,
                          "--compare", "--timeline", str(png), "--json")
    assert code == 0, err
    doc = json.loads(out)
    tls = {tl["method"]: tl for tl in doc["timelines"]}
    assert list(tls) == ["lynx", "monolithic-bf16", "monolithic-full", "anchor-only"]
    _check_lynx(tls["lynx"], 16)
    rows = {r["method"]: r for r in doc["compare"]["rows"]}
    for name in ("monolithic-bf16", "monolithic-full", "anchor-only"):
        tl = tls[name]
        assert tl["draft_steps"] == [] and tl["residual_layers"] == []
        assert tl["residual_ready_s"] == rows[name]["runs"][0]["ready_s"]  # its whole transfer, then decoding
        assert len(tl["tokens_s"]) == 16 and tl["tokens_s"][0] >= tl["residual_ready_s"]
        assert len(tl["decode_steps"]) == (16 if name == "anchor-only" else 15), name  # anchor only: no verify
    assert tls["anchor-only"]["verified"] is False
    assert png.read_bytes().startswith(PNG)


@pytest.mark.parametrize("target, message", [("t.txt", "expected a .png"), ("missing/t.png", "does not exist")])
def test_bad_timeline_path_is_refused_before_the_run(tiny_cache, capsys, tmp_path, target, message):
    model_dir, path, _ = tiny_cache
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "4", "--timeline", str(tmp_path / target))
    assert code != 0
    assert "lynxkv: error: --timeline" in err and message in err and "loading model" not in err
