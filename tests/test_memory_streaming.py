"""Peak memory of the commands that walk a whole cache: ``encode`` of a 268 MB BF16 dump, ``verify``, ``decode``
and ``decode --anchor-only`` each raise a fresh process's RSS above what importing lynxkv and torch left by at most
LIMIT (a few layers' worth: they hold a window of layers, not the cache). Measured with the kernel's high-water
mark (``VmHWM``, reset through ``/proc/self/clear_refs`` once the imports are done)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from peak_rss import CHILD_PRELUDE, can_reset_peak

pytestmark = pytest.mark.slow

SHAPE = (64, 8, 2048, 128)  # layers, KV heads, tokens, head dim: Llama-3-8B's heads, twice its layers, at 2K tokens
DUMP = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] * 2  # K and V in BF16: 268 MB
LIMIT = 150 << 20  # 4 MB per layer in BF16; the quantizer's fp32 work on two layers at once fits many times over

CHILD = r'''
import json, os, sys
import torch, lynxkv, lynxkv.cache, lynxkv.cli, safetensors.torch
from lynxkv.cli import main

''' + CHILD_PRELUDE + r'''
work, argv = sys.argv[1], sys.argv[2:]
base = rss("VmRSS")
reset_peak()
code = main(argv)
print("MEMORY " + json.dumps({"code": code, "above": rss("VmHWM") - base}))
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from lynxkv.cache.dumps import write_kv_safetensors

    if not can_reset_peak():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    d = tmp_path_factory.mktemp("memory_streaming")
    layers, heads, tokens, dim = SHAPE
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(heads, tokens, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    kv = ((keys * (1 + i / layers), values) for i in range(layers))  # what the layers hold is not measured here
    write_kv_safetensors(d / "kv.safetensors", kv, layers=layers, shape=(heads, tokens, dim), dtype=torch.bfloat16)
    assert (d / "kv.safetensors").stat().st_size > DUMP
    return d


def _peak(work, *argv) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(work), *map(str, argv)], cwd=work, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    result = json.loads(lines[-1][len("MEMORY "):])
    assert result["code"] == 0, proc.stderr[-2000:]
    return result["above"]


def test_encode_verify_decode_hold_a_window_not_the_cache(work):
    """One test, in order: each command needs the file the one before it wrote."""
    peaks = {
        "encode": _peak(work, "encode", work / "kv.safetensors", "-o", work / "c.lynx", "--force"),
        "verify": _peak(work, "verify", work / "c.lynx"),
        "decode": _peak(work, "decode", work / "c.lynx", "-o", work / "out.safetensors", "--force"),
        "decode --anchor-only": _peak(work, "decode", work / "c.lynx", "-o", work / "anchor.safetensors",
                                      "--anchor-only", "--force"),
    }
    assert all(peak < LIMIT for peak in peaks.values()), {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
    assert (work / "out.safetensors").stat().st_size > DUMP


def test_encode_holds_pieces_of_a_layer_within_memory(tmp_path):
    """A dump of two 134 MB layers (Llama-3-8B's heads at 64K tokens): ``encode --memory 32MiB`` quantizes and
    writes each layer in pieces of whole pages, well under half a layer (the bound, and the encoder's own ~25 MiB
    of buffers and threads); the default stays under its own 256 MiB."""
    from lynxkv.cache.dumps import write_kv_safetensors

    if not can_reset_peak():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    heads, tokens, dim = 8, 65536, 128
    layer = 2 * heads * tokens * dim * 2
    g = torch.Generator().manual_seed(0)
    kv = (tuple(torch.randn(heads, tokens, dim, generator=g).to(torch.bfloat16) for _ in range(2)) for _ in range(2))
    write_kv_safetensors(tmp_path / "kv.safetensors", kv, layers=2, shape=(heads, tokens, dim), dtype=torch.bfloat16)
    peaks = {memory: _peak(tmp_path, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "c.lynx", "--force",
                           *(["--memory", memory] if memory else []))
             for memory in ("32MiB", None)}
    shown = {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
    assert peaks["32MiB"] < layer // 2 and peaks[None] < 256 << 20, shown
