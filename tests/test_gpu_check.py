"""benchmarks/gpu_check.sh: its dry run on the CPU (every step of the GPU check at toy sizes, the reports it
writes), and the report's verdict on failed, timed-out and skipped steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "codec", "user_path", "runner", "kernels"]


def _entries() -> dict[str, list[str]]:
    """What the checkout's kernels/ and lynxkv/ hold (links included, bytecode caches left out)."""
    return {d: sorted(p.name for p in (ROOT / d).iterdir() if p.name != "__pycache__") for d in ("kernels", "lynxkv")}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("gpu_check")
    before = _entries()
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "PYTHON": sys.executable})
    return proc, out, before


def test_dry_run_passes_every_step(dry_run):
    proc, out, before = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["dry"] is True and rep["ok"] is True and rep["tokens_identical"] is True
    assert list(rep["steps"]) == STEPS
    assert {name: s["status"] for name, s in rep["steps"].items()} == dict.fromkeys(STEPS, "ok")
    assert all(s["seconds"] <= s["limit_s"] for s in rep["steps"].values())
    env = rep["steps"]["env"]["result"]
    assert not env["lynxkv_from"].startswith(str(ROOT)), "imported the checkout's lynxkv/, not the import root"
    assert _entries() == before  # the import root left the checkout as it was


def test_dry_run_results_hold_every_measurement(dry_run):
    proc, out, _ = dry_run
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    kernels = steps["kernels"]["result"]
    assert kernels["tests"] > 0 and kernels["failures"] == kernels["errors"] == kernels["skipped"] == 0
    codec = steps["codec"]["result"]
    assert all(r["bit_exact_vs_reference"] and r["round_trip_within_step"] for r in codec["runs"])
    assert {"device copy", "encode (fused Triton)", "decode full (fused Triton)"} <= {r["op"] for r in codec["rows"]}
    user = steps["user_path"]["result"]["runs"]
    assert len(user) == 2 and all(r["ok"] and r["on_device"] for r in user)
    timed = ("save_s", "load_full_s", "load_anchor_s", "safetensors_load_to_device_s")
    assert all(r[k] > 0 for r in user for k in timed)
    runner = steps["runner"]["result"]
    assert [length["tokens"] for length in runner["runs"]] == [32, 64]
    n = runner["new_tokens"]
    for length in runner["runs"]:
        assert [r["gbits"] for r in length["rates"]] == runner["gbits"] and len(runner["gbits"]) == 3
        for r in length["rates"]:
            assert r["lynx_identical"] is True and r["monolithic_identical"] is True, r
            for run in (r["lynx"], r["monolithic"]):
                assert 0 < run["tt1_s"] <= run[f"tt{n}_s"] and run["first_commit_s"] == run["tt1_s"]
            assert r["monolithic"]["drafted"] == 0 and r["monolithic"]["decode_step_s"] > 0
            # the full code waits for the residual (its clock starts a little after the emulated link's)
            assert r["monolithic"]["tt1_s"] >= 0.5 * r["residual_due_s"] > 0
    cli = runner["cli"]  # the command users run, with the device the check runs on
    assert cli["ok"] is True and cli["identical"] is True and cli["verified"] is True, cli
    assert cli["command"].startswith("lynxkv run ") and "--device cpu" in cli["command"]
    assert 0 < cli["tt1_s"] <= cli[f"tt{n}_s"] < cli["process_s"]
    md = (out / "gpu_check.md").read_text()
    for heading in ("# lynxkv GPU check", "## Encode and decode", "## save_cache / load_kv(device)",
                    "## Speculative runner", "Tokens identical to plain decoding: True",
                    "The command users run, in a process of its own: `lynxkv run "):
        assert heading in md


def _status(steps: Path, name: str, rc: int, seconds: int, limit: int, log: str = "") -> None:
    (steps / f"{name}.status").write_text(f"{rc} {seconds} {limit}\n")
    (steps / f"{name}.log").write_text(log)


def test_report_names_failed_timed_out_and_skipped_steps(tmp_path):
    """A step that failed, ran out of time or found no budget left is reported as such, with the end of its log,
    and the verdict is a failure; the steps that ran are still reported."""
    steps = tmp_path / "steps"
    steps.mkdir()
    _status(steps, "env", 0, 3, 30)
    (steps / "env.json").write_text(json.dumps({"card": "X"}))
    _status(steps, "kernels", 1, 20, 100, "E   AssertionError: codes differ\n")
    _status(steps, "codec", 124, 60, 60, "still encoding\n")
    _status(steps, "user_path", -1, 0, 0)
    rows = [{"gbits": 10.0, "residual_due_s": 0.5, "tokens_identical": True, "lynx": {}, "monolithic": {}}]
    (steps / "runner.json").write_text(json.dumps({"new_tokens": 64, "runs": [{"tokens": 8, "rates": rows}]}))
    _status(steps, "runner", 0, 9, 150)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check_report import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rc = report(str(steps), str(tmp_path / "r.json"), str(tmp_path / "r.md"), dry=False)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and rep["ok"] is False and rep["tokens_identical"] is True
    assert {n: s["status"] for n, s in rep["steps"].items()} == {
        "env": "ok", "codec": "timeout", "user_path": "skipped", "runner": "ok", "kernels": "failed"}
    assert "codes differ" in rep["steps"]["kernels"]["log_tail"]
    md = (tmp_path / "r.md").read_text()
    assert "| codec | timeout | 60 | 60 |" in md and "still encoding" in md
