"""The compiled extensions' bindings (cffi modules typed by lynxkv/quant/_native.h, _remainder.h and
lynxkv/format/_crc.h): a call that does not fit the C types fails in Python, and without any compiled code
(``LYNXKV_NATIVE=0``, what an install without a C compiler runs) the files and values are the same."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lynxkv import open_cache, save_cache
from lynxkv.compiled import load_module
from lynxkv.quant import c_kernels, fast

compiled_only = pytest.mark.skipif(not fast.available(), reason="the compiled kernels were not built")


@compiled_only
def test_a_call_that_does_not_fit_the_header_fails_before_any_c_runs():
    codes = np.arange(8, dtype=np.uint8)
    out = np.full(16, 0xFF, dtype=np.uint8)
    with pytest.raises(TypeError):  # one argument short
        c_kernels.NATIVE.lynx_unpack4(c_kernels.FFI.from_buffer("uint8_t[]", codes),
                                      c_kernels.FFI.from_buffer("uint8_t[]", out), 0)
    with pytest.raises(TypeError):  # a float pointer where the header says uint8_t *
        c_kernels.NATIVE.lynx_unpack4(c_kernels.FFI.from_buffer("float[]", np.zeros(2, np.float32)),
                                      c_kernels.FFI.from_buffer("uint8_t[]", out), 0, 8)
    with pytest.raises(TypeError):  # a Python int where the header says a pointer
        c_kernels.NATIVE.lynx_unpack4(codes.ctypes.data, c_kernels.FFI.from_buffer("uint8_t[]", out), 0, 8)
    with pytest.raises(OverflowError):  # past int64_t
        c_kernels.NATIVE.lynx_unpack4(c_kernels.FFI.from_buffer("uint8_t[]", codes),
                                      c_kernels.FFI.from_buffer("uint8_t[]", out), 0, 1 << 64)
    assert (out == 0xFF).all()  # nothing was written by the refused calls
    assert c_kernels.NATIVE.lynx_unpack4(c_kernels.FFI.from_buffer("uint8_t[]", codes),
                                         c_kernels.FFI.from_buffer("uint8_t[]", out), 0, 8) == 0
    assert out.tolist() == [v for b in range(8) for v in (b & 0x0F, b >> 4)]


_WITHOUT_NATIVE = """
import sys, torch
from lynxkv import open_cache, save_cache
from lynxkv.compiled import load_module
from lynxkv.quant import fast, remainder
assert not fast.available() and not remainder.compiled()
kv = torch.load(sys.argv[1])
save_cache(sys.argv[2], kv, cache_id=bytes(16))
with open_cache(sys.argv[2]) as cache:
    torch.save([cache.load_kv(), cache.load_kv(anchor_only=True)], sys.argv[3])
"""


@compiled_only
def test_without_compiled_code_the_files_and_values_are_the_same(tmp_path):
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(3, 301, 64, generator=g).to(torch.bfloat16) * (i + 1),
           torch.randn(3, 301, 64, generator=g).to(torch.bfloat16)) for i in range(2)]
    torch.save(kv, tmp_path / "kv.pt")
    (tmp_path / "c").mkdir()
    (tmp_path / "r").mkdir()  # the same file names: the anchor header names its residual file
    save_cache(tmp_path / "c" / "x.lynx", kv, cache_id=bytes(16))
    env = dict(os.environ, LYNXKV_NATIVE="0")
    done = subprocess.run([sys.executable, "-c", _WITHOUT_NATIVE, str(tmp_path / "kv.pt"), str(tmp_path / "r" / "x.lynx"),
                           str(tmp_path / "values.pt")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for suffix in (".lynx", ".lynxr"):
        compiled, fallback = ((tmp_path / side / f"x{suffix}").read_bytes() for side in ("c", "r"))
        assert compiled == fallback, suffix
    full, anchor = torch.load(tmp_path / "values.pt")
    with open_cache(tmp_path / "c" / "x.lynx") as cache:
        for got, want in ((full, cache.load_kv()), (anchor, cache.load_kv(anchor_only=True))):
            for pair_got, pair_want in zip(got, want, strict=True):
                for a, b in zip(pair_got, pair_want, strict=True):
                    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_stale_build_without_its_binding_falls_back_with_a_warning(tmp_path, monkeypatch):
    """A library left from before the cffi bindings (a module without ``ffi``/``lib``) is not called: the loader
    warns and the pure-Python path runs."""
    (tmp_path / "lynxkv_stale_ext.py").write_text("# a module without ffi and lib\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="stale build"):
        assert load_module("lynxkv_stale_ext") is None
    assert load_module("lynxkv_not_built_ext") is None  # not there at all: no warning needed
    monkeypatch.setenv("LYNXKV_NATIVE", "0")
    assert load_module("lynxkv.quant._native") is None
