"""``load_kv(device=...)`` and ``save_cache`` of device tensors: the device is honoured, bad ones are refused
clearly, and the on-device decode path (the one a GPU takes) gives the compiled CPU path's values bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lynxkv
from lynxkv.quant import fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kv(layers=2, heads=2, tokens=600, dim=64, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple((torch.randn(heads, tokens, dim, generator=g) * 3 + 1).to(dtype).to(device) for _ in range(2))
            for _ in range(layers)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "zstd"])
def cache_path(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dev") / "c.lynx")  # 600 tokens: two full pages and a short one
    lynxkv.save_cache(path, _kv(dtype=torch.bfloat16), zstd=request.param)
    return path


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
def test_load_kv_honours_a_cpu_device(cache_path, device, anchor_only):
    with lynxkv.open_cache(cache_path) as cache:
        default = cache.load_kv(anchor_only=anchor_only)
        got = cache.load_kv(anchor_only=anchor_only, device=device)
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for pair in got for t in pair)
    assert _same(default, got)


@pytest.mark.parametrize("device,says", [
    ("meta", "hold no values"),
    ("bogus", "not a torch device"),
    (f"cuda:{torch.cuda.device_count()}", "not available"),  # one past the last GPU, or the first of none
], ids=["meta", "unknown-name", "missing-gpu"])
def test_load_kv_refuses_a_device_it_cannot_fill(cache_path, device, says):
    with lynxkv.open_cache(cache_path) as cache:
        with pytest.raises(lynxkv.InputError, match=says):
            cache.load_kv(device=device)


def test_save_cache_refuses_meta_tensors(tmp_path):
    kv = [(torch.empty(2, 8, 16, device="meta"), torch.empty(2, 8, 16, device="meta"))]
    with pytest.raises(lynxkv.InputError, match="meta tensor"):
        lynxkv.save_cache(str(tmp_path / "m.lynx"), kv)
    assert not (tmp_path / "m.lynx").exists()


@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
def test_device_path_gives_the_compiled_path_values(cache_path, anchor_only, monkeypatch):
    """Without the compiled kernels a CPU tensor takes the path every other device takes (record bytes to the
    device, pages batched, the reference there): the same values as the compiled path, sink tokens included."""
    if not fast.available():
        pytest.skip("the compiled CPU kernels are not built: nothing to compare with")
    with lynxkv.open_cache(cache_path) as cache:
        want = cache.load_kv(anchor_only=anchor_only, dtype=torch.float32)
        monkeypatch.setattr(fast, "available", lambda: False)
        got = cache.load_kv(anchor_only=anchor_only, dtype=torch.float32)
    assert _same(want, got)


def test_device_path_launches_the_triton_kernels_under_the_interpreter(tmp_path):
    """The batched Triton launches a GPU makes (full pages of a layer at once, into strided views of the output),
    run by Triton's interpreter on the CPU: fp32 values equal to the compiled path's, anchor-only included."""
    pytest.importorskip("triton")
    if not fast.available():
        pytest.skip("the compiled CPU kernels are not built: nothing to compare with")
    script = textwrap.dedent(f"""
        import torch, lynxkv, lynxkv.kernels.decode as kd
        from lynxkv.quant import fast
        launches = []
        real = kd.decode
        kd.decode = lambda *a, **k: launches.append(tuple(a[5].shape)) or real(*a, **k)
        g = torch.Generator().manual_seed(1)
        kv = [tuple(torch.randn(2, 600, 64, generator=g) for _ in range(2)) for _ in range(2)]
        path = {str(tmp_path / "t.lynx")!r}
        lynxkv.save_cache(path, kv)
        with lynxkv.open_cache(path) as cache:
            want = [cache.load_kv(anchor_only=a) for a in (False, True)]
            fast.available = lambda: False
            got = [cache.load_kv(anchor_only=a) for a in (False, True)]
        same = all(torch.equal(x, y) for w, o in zip(want, got) for pw, po in zip(w, o) for x, y in zip(pw, po))
        print("SAME", same, "BATCHED", sum(1 for s in launches if s[0] == 2))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    words = res.stdout.split()
    assert words[words.index("SAME") + 1] == "True"
    assert int(words[words.index("BATCHED") + 1]) == 2 * 2 * 2  # 2 loads x 2 layers x (keys, values)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("anchor_only", [False, True], ids=["full", "anchor"])
def test_load_kv_on_cuda_is_the_cpu_load(tmp_path, anchor_only):
    """Saved from GPU tensors, loaded onto the GPU (the Triton kernels there): the CPU load's values bit for bit."""
    path = str(tmp_path / "g.lynx")
    lynxkv.save_cache(path, _kv(dtype=torch.bfloat16, device="cuda"))
    with lynxkv.open_cache(path) as cache:
        want = cache.load_kv(anchor_only=anchor_only)
        got = cache.load_kv(anchor_only=anchor_only, device="cuda")
    assert all(t.is_cuda for pair in got for t in pair)
    assert _same(want, got)
