"""The wheel users install (benchmarks/wheel_check.sh): built from the sdist of this tree, installed into a fresh
venv outside the checkout, ``lynxkv --version`` and an encode / verify / decode round trip from an empty
directory, the compiled modules present where a C compiler is. Offline; about 20 s on 2 cores."""

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
def test_the_wheel_installs_and_round_trips_outside_the_checkout():
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)  # the installed wheel, not this checkout
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "wheel_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "wheel_check: round trip ok: 4 tensors" in done.stderr
    assert done.stderr.rstrip().endswith("wheel_check: ok")
