"""Shared by the peak-memory tests: whether this machine can reset a process's RSS high-water mark, and the lines a
child process starts with to read its RSS (``rss("VmRSS")``, ``rss("VmHWM")``) and to reset the mark."""

from __future__ import annotations

CHILD_PRELUDE = r'''
def rss(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the RSS now
'''


def can_reset_peak() -> bool:
    """Whether ``/proc/self/clear_refs`` takes a reset of the high-water mark here (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
