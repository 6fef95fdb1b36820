"""The benchmarks run end to end at small sizes (their numbers are not checked here: benchmarks, not timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(args, tmp_path, **env):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "LYNXKV_BENCH_CACHE": str(tmp_path / "cache"), **env},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_bench_codec_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = run(["benchmarks/bench_codec.py", "--quick", "--json", str(out), "--tmp", str(tmp_path)], tmp_path)
    data = json.loads(out.read_text())
    assert data["fast_bit_exact"] is True
    methods = {r["method"] for r in data["rows"]}
    assert {"copy", "safetensors", "zstd-3", "int8/token", "lynxkv-ref", "lynxkv-fast", "lynxkv-anchor"} <= methods
    for r in data["rows"]:
        assert r["encode_s"] and all(t > 0 for t in r["encode_s"]), r
        assert len(r["encode_cpu_s"]) == len(r["encode_s"]) and len(r["decode_cpu_s"]) == len(r["decode_s"]), r
        assert r["stored_bytes"] > 0
    fast = next(r for r in data["rows"] if r["method"] == "lynxkv-fast")
    assert fast["stored_bytes"] * 16 / fast["bf16_bytes"] == pytest.approx(9.0, rel=1e-3)  # 8 bits + fp16 meta / 32
    assert "lynxkv-fast" in proc.stdout


def test_gpu_check_script_dry_run(tmp_path):
    """gpu_check.sh's plumbing (import root without installing lynxkv, the test run, the benchmark, the files
    under $OUT) on a CPU under the Triton interpreter at toy sizes. It leaves the checkout as it found it (its
    import root once put a link named kernels inside kernels/)."""
    pytest.importorskip("triton")
    out = tmp_path / "out"
    before = _entries()
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    origin = proc.stdout.split("lynxkv from ", 1)[1].split()[0]
    assert not origin.startswith(str(ROOT)), f"imported the repository's lynxkv/ ({origin}), not the import root"
    data = json.loads((out / "gpu_bench.json").read_text())
    assert data["runs"][0]["bit_exact_vs_reference"] and data["runs"][0]["round_trip_within_step"]
    assert {r["op"] for r in data["rows"]} >= {"device copy", "encode (fused Triton)", "decode full (fused Triton)"}
    assert (out / "gpu_check.log").read_text().count("== done: tests rc=0, benchmark rc=0") == 1
    assert (out / "gpu_tests.xml").exists()
    assert _entries() == before


def _entries() -> dict[str, list[str]]:
    """What the checkout's kernels/ and lynxkv/ hold (links included, bytecode caches left out)."""
    return {d: sorted(p.name for p in (ROOT / d).iterdir() if p.name != "__pycache__") for d in ("kernels", "lynxkv")}
