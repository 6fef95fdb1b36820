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
