"""Peak memory of the read paths: decoding, loading, saving a streamed copy and the progressive load of a 134 MB
BF16 cache each raise a fresh process's RSS above what importing lynxkv and torch left by at most half the
decoded size beyond the caches they hand back (1.5x for one cache; the progressive load hands back two, the
anchor-only and the full KV). Measured with the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` once the imports are done); benchmarks/memory_paths.py prints the figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from peak_rss import CHILD_PRELUDE, can_reset_peak

pytestmark = pytest.mark.slow

SHAPE = (16, 8, 2048, 128)  # layers, KV heads, tokens, head dim: Llama-3-8B's heads at 2K tokens
DECODED = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] * 2  # K and V in BF16: 134 MB
SLACK = 0.5  # what a path may hold beyond its outputs, as a fraction of the decoded size

CHILD = r'''
import json, os, sys
import torch, lynxkv, lynxkv.cache, lynxkv.cli, lynxkv.stream.progressive, safetensors.torch
from lynxkv.cli import main

''' + CHILD_PRELUDE + r'''
path, cache, work = sys.argv[1:4]
base = rss("VmRSS")
reset_peak()
held, code = [], 0
if path == "decode":
    code = main(["decode", cache, "-o", os.path.join(work, "out.safetensors"), "--force"])
elif path == "load_kv":
    with lynxkv.cache.open_cache(cache) as c:
        held.append(c.load_kv())
elif path == "stream-o":
    code = main(["stream", cache, "-o", os.path.join(work, "copy", "copy.lynx"), "--force", "--json"])
elif path == "progressive":
    with lynxkv.stream.progressive.open_progressive(cache, dtype=torch.bfloat16) as load:
        held.append((load.wait_anchor(), load.residual.result()))
print("MEMORY " + json.dumps({"code": code, "above": rss("VmHWM") - base}))
'''


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from lynxkv.cache import save_cache

    if not can_reset_peak():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    d = tmp_path_factory.mktemp("memory")
    layers, heads, tokens, dim = SHAPE
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(heads, tokens, dim, generator=g).to(torch.bfloat16),
           torch.randn(heads, tokens, dim, generator=g).to(torch.bfloat16)) for _ in range(layers)]
    save_cache(d / "c.lynx", kv)
    (d / "copy").mkdir()
    return d


@pytest.mark.parametrize("path, outputs", [("decode", 1), ("load_kv", 1), ("stream-o", 1), ("progressive", 2)])
def test_peak_rss_above_the_imported_process(cache, path, outputs):
    proc = subprocess.run([sys.executable, "-c", CHILD, path, str(cache / "c.lynx"), str(cache)], cwd=cache,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    got = json.loads(lines[-1][len("MEMORY "):])
    assert got["code"] == 0, proc.stderr[-2000:]
    ratio = got["above"] / DECODED
    limit = outputs + SLACK
    assert ratio <= limit, (f"{path}: peak RSS {got['above'] / 1e6:.0f} MB above the imported process, "
                            f"{ratio:.2f}x the {DECODED / 1e6:.0f} MB decoded, more than {limit}x")
