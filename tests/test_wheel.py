"""The wheel users install (benchmarks/wheel_check.sh): built from the sdist of this tree, installed into a fresh
venv outside the checkout, ``lynxkv --version`` and an encode / verify / decode round trip from an empty
directory; with a C compiler the compiled modules are in the wheel, without one (``NO_COMPILER=1``: ``CC=false``)
the build goes on, no compiled module is there and the pure-Python paths do the round trip. Offline; about 20 s
each on 2 cores."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="the check packs the tree's files with git ls-files")
@pytest.mark.parametrize("no_compiler", ["0", "1"], ids=["with-compiler", "without-compiler"])
def test_the_wheel_installs_and_round_trips_outside_the_checkout(no_compiler):
    if no_compiler == "0" and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the without-compiler case covers this machine")
    env = dict(os.environ, PYTHON=sys.executable, NO_COMPILER=no_compiler)
    env.pop("PYTHONPATH", None)  # the installed wheel, not this checkout
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "wheel_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "wheel_check: round trip ok: 4 tensors" in done.stderr
    assert done.stderr.rstrip().endswith("wheel_check: ok")
