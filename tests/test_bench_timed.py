"""lynxkv.bench.timed: a command's output, wall clock and peak memory as GNU time measures them."""

from __future__ import annotations

import os
import sys

import pytest

from lynxkv.bench.timed import TIME, run_timed

pytestmark = pytest.mark.skipif(not os.access(TIME, os.X_OK), reason=f"{TIME} (GNU time) is not installed")


def test_a_command_is_timed_with_its_output_and_its_peak_memory():
    code = "import sys, time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.3); " \
           "print('done'); print('GNU time writes here too', file=sys.stderr)"
    t = run_timed([sys.executable, "-c", code])
    assert t.stdout == "done\n"
    assert t.wall_s >= 0.3
    assert t.peak_mib >= 200  # the 200 MiB it touched


def test_a_command_that_fails_raises_with_its_stderr():
    with pytest.raises(RuntimeError, match="(?s)failed \\(3\\).*went wrong"):
        run_timed([sys.executable, "-c", "import sys; print('went wrong', file=sys.stderr); sys.exit(3)"])
