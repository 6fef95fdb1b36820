"""``lynxkv run`` end to end on a tiny model saved as a Hugging Face directory, through the progressive reader."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_llama
from lynxkv.cli import main
from lynxkv.speculative import decode_plain
from lynxkv.bench.simulated import split_kv
from lynxkv.quant.scheme import get_scheme
from runner_helpers import save_tiny_model_dir, single_thread, text_of, tiny_llama_cache

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("runcli")
    model, model_dir, path, ids, kv = tiny_llama_cache(d)
    _, full_kv = split_kv(kv, get_scheme())
    want = decode_plain(model, full_kv, ids, 24)
    return model_dir, path, want, d


def _run(capsys, *args):
    code = main(["run", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_json_output_equals_full_cache_decoding(tiny_cache, capsys):
    model_dir, path, want, _ = tiny_cache
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth", "8MB/s", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == want
    assert doc["text"] == text_of(want)
    assert doc["verified"] is True
    s = doc["stats"]
    assert s["committed"] == 24 and s["anchor_ready_s"] < s["residual_ready_s"] <= s["tt1_s"]
    assert s["load"]["anchor_bytes"] > 0 and s["load"]["residual_bytes"] > 0


def test_plain_output_and_stats_table(tiny_cache, capsys):
    model_dir, path, want, _ = tiny_cache
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth", "8MB/s")
    assert code == 0, err
    assert out.startswith(text_of(want))
    for label in ("anchor ready", "residual ready", "first draft token", "TT1 / TT32 / TT64", "drafted / accepted",
                  "acceptance rate", "Δ theoretical"):
        assert label in out


def test_compare_runs_all_baselines(tiny_cache, capsys):
    model_dir, path, want, _ = tiny_cache
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth", "8MB/s",
                          "--compare", "--json")
    assert code == 0, err
    cmp = json.loads(out)["compare"]
    rows = {r["method"]: r for r in cmp["rows"]}
    assert set(rows) == {"lynx", "monolithic-bf16", "monolithic-full", "anchor-only"}
    assert rows["monolithic-full"]["same_tokens_as_lynx"] is True
    assert rows["anchor-only"]["verified"] is False
    # the monolithic transfers were waited for: nothing is decoded before its bytes would have arrived
    for name in ("monolithic-bf16", "monolithic-full", "anchor-only"):
        assert rows[name]["tt1_s"] >= rows[name]["ready_s"]
    b = cmp["bytes"]
    assert rows["monolithic-full"]["ready_s"] == pytest.approx((b["anchor"] + b["residual"]) / 8e6)
    assert rows["monolithic-bf16"]["ready_s"] > rows["monolithic-full"]["ready_s"] > rows["anchor-only"]["ready_s"]
    assert cmp["judge"]["tt_lynx_s"] is None  # fewer than 64 tokens: no TT64 verdict is made up


def test_compare_reports_what_tt64_measured(tiny_cache, capsys, monkeypatch):
    import io

    from rich.console import Console

    import lynxkv.cli.run as run_cli

    model_dir, path, _, _ = tiny_cache
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "64", "--ignore-eos", "--bandwidth", "8MB/s",
                          "--compare", "--json")
    assert code == 0, err
    doc = json.loads(out)
    cmp = doc["compare"]
    assert cmp["repeats"] == 1
    rows = {r["method"]: r for r in cmp["rows"]}
    assert rows["lynx"]["same_tokens_as_lynx"] and rows["monolithic-full"]["same_tokens_as_lynx"]
    assert rows["lynx"]["tt64_s"] == doc["stats"]["tt64_s"]
    j = cmp["judge"]
    assert j["tt_lynx_s"] == rows["lynx"]["tt64_s"] and j["tt_full_s"] == rows["monolithic-full"]["tt64_s"]
    assert j["gain_over_delta"] == pytest.approx(j["gain_measured_s"] / j["delta_theoretical_s"])
    assert j["ratio_to_anchor_only"] == pytest.approx(j["tt_lynx_s"] / j["tt_anchor_only_s"])

    shown = io.StringIO()  # a wide console of its own: the shared one's width may be set by another test
    monkeypatch.setattr(run_cli, "out", Console(file=shown, width=300))
    code, _, err = _run(capsys, path, "--model", model_dir, "-n", "64", "--ignore-eos", "--bandwidth", "8MB/s",
                        "--compare")
    assert code == 0, err
    words = " ".join(shown.getvalue().split())  # a table's title wraps at the table's width
    assert "one run each" in words and "TT64: lynx" in words and "Δ" in words and "target" not in words


def test_the_run_knows_its_step_before_drafting(tiny_cache, capsys, monkeypatch):
    # `lynxkv run` times a decode step at the cache's length before it opens the load, so its first window is
    # judged: a residual due within a few steps is waited for, with the same tokens
    from lynxkv.speculative import Timing

    model_dir, path, want, _ = tiny_cache
    calls = []

    def slow_machine(self, model, tokens, steps=3):  # as if a step took 10 s: every residual is due within 4
        calls.append(tokens)
        self.note_step(tokens, 10.0)
        return 10.0

    with monkeypatch.context() as m:
        m.setattr(Timing, "calibrate", slow_machine)
        code, out, err = _run(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth", "8MB/s",
                              "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert calls == [len(doc["prompt_token_ids"])]
    assert doc["token_ids"] == want
    assert doc["stats"]["drafted"] == 0
    assert "waiting for it instead of drafting" in doc["stats"]["drafting_disabled"]
    # this machine's real step: at 1 MB/s the residual leaves room to draft
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth", "1MB/s",
                          "--max-window", "8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == want and doc["stats"]["drafted"] > 0 and doc["stats"]["drafting_disabled"] is None


def test_wrong_model_is_one_clear_error(tiny_cache, capsys, tmp_path):
    _, path, _, _ = tiny_cache
    other = save_tiny_model_dir(make_tiny_llama(5, layers=3, head_dim=32), tmp_path / "other")
    code, out, err = _run(capsys, path, "--model", other, "-n", "4")
    assert code == 1 and "another model" in err and "Traceback" not in err


def test_missing_residual(tiny_cache, capsys, tmp_path):
    model_dir, path, _, d = tiny_cache
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "4", "--residual", str(tmp_path / "gone.lynxr"))
    assert code == 1 and "residual" in err and "Traceback" not in err
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "6", "--ignore-eos", "--json",
                          "--residual", str(tmp_path / "gone.lynxr"), "--allow-anchor-only")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["verified"] is False and doc["stats"]["residual_error"] and len(doc["token_ids"]) == 6


def test_terminal_view_shows_drafts_dim_and_retracts_them(tiny_cache, monkeypatch):
    """On a terminal, drafts are shown provisionally and withdrawn when retracted; the end state is the
    committed text alone."""
    import io

    from rich.console import Console

    import lynxkv.cli.run as run_cli
    from lynxkv.hf.models import load_model
    from lynxkv.speculative import Event

    model_dir = tiny_cache[0]
    tok = load_model(model_dir).tokenizer
    monkeypatch.setattr(run_cli, "out", Console(file=io.StringIO(), force_terminal=True, width=200))
    p = run_cli._Printer(tok, live=True)
    assert p.live is not None
    views = []
    for ev in [Event("draft", 0.1, tokens=[5]), Event("draft", 0.2, tokens=[6]), Event("draft", 0.3, tokens=[7]),
               Event("commit", 0.4, tokens=[5], confirmed=1), Event("retract", 0.4, count=2),
               Event("commit", 0.4, tokens=[9])]:
        p.event(ev)
        views.append((p.view.plain, [s.style for s in p.view.spans]))
    p.close()
    assert views[2][0] == text_of([5, 6, 7]) and views[2][1] == ["dim"]  # all provisional, dim
    assert views[3][0] == text_of([5, 6, 7])  # w5 now final, w6 w7 still dim
    assert views[4] == (text_of([5]), [])  # retracted
    assert views[5][0] == text_of([5, 9]) and p.committed == [5, 9]


def test_the_output_is_printed_before_a_timeline_that_cannot_be_written(tiny_cache, capsys, tmp_path, monkeypatch):
    """A --timeline whose write fails (a full disk) after the run loses none of the run's output."""
    import lynxkv.storage
    from lynxkv.errors import InputError

    model_dir, path, want, _ = tiny_cache

    def full(target, data):
        raise InputError(f"{target}: no space left on the device; nothing was written")

    monkeypatch.setattr(lynxkv.storage, "write_atomic", full)
    code, out, err = _run(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--json",
                          "--timeline", str(tmp_path / "t.png"))
    assert code == 1 and "no space left" in err and json.loads(out)["token_ids"] == want
