"""One command timed as a process of its own, as the benchmarks time the CLI: its wall clock and peak resident set
from GNU time (``/usr/bin/time``), and its standard output."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

TIME = "/usr/bin/time"
_MARK = "LYNXKV-TIMED"  # the last stderr line GNU time writes, told apart from the command's own


@dataclass(frozen=True)
class Timed:
    stdout: str
    wall_s: float
    peak_mib: float


def run_timed(argv: list[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None) -> Timed:
    """Run ``argv`` under GNU time; a command that fails raises :class:`RuntimeError` with the end of its stderr."""
    if not os.access(TIME, os.X_OK):
        raise RuntimeError(f"{TIME} (GNU time) is needed to time a command's wall clock and peak memory")
    proc = subprocess.run([TIME, "-f", f"{_MARK} %e %M", *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith(_MARK + " ")][-1].split()
    return Timed(proc.stdout, float(line[1]), int(line[2]) / 1024)
