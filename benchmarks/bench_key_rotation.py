"""What the key rotation costs on the user path: the default scheme against the same scheme with
``key_rotation="none"``, side by side in one process, through the public API, interleaved, medians.

Steps, each timed in wall seconds and in CPU seconds of this process (the CPU figure is the one to read on a
shared machine: other jobs lengthen the wall time, not this process's CPU time):

- ``save_cache`` (the rotation runs in torch before the encode kernel);
- ``load_kv()`` and ``load_kv(anchor_only=True)`` (the compiled decode rotates each key row back in its pass);
- ``open_progressive(path)`` until ``wait_anchor()`` returns.

Cache: the synthetic Llama-3-8B-shaped BF16 cache of ``bench_user_path.py`` (16 layers x 8 KV heads x 4,096
tokens x 128, 268 MB), or fewer layers with ``--layers``.

    python benchmarks/bench_key_rotation.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codec import synthetic_kv  # noqa: E402 - the benchmarks share one synthetic KV generator

import lynxkv  # noqa: E402
from lynxkv.quant.scheme import get_scheme  # noqa: E402
from lynxkv.stream import open_progressive  # noqa: E402


def timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def progressive_anchor(path: str) -> None:
    with open_progressive(path) as load:
        load.wait_anchor(600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    flat = synthetic_kv(args.layers, 8, 4096, 128)
    kv = list(zip(flat[0::2], flat[1::2]))
    schemes = {"rotated (default)": get_scheme("default"), "not rotated": get_scheme("default", key_rotation="none")}
    steps = ("save_cache", "load_kv", "load_anchor", "progressive_anchor")
    samples = {(name, step): [] for name in schemes for step in steps}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: os.path.join(tmp, f"{i}.lynx") for i, name in enumerate(schemes)}
        for name, scheme in schemes.items():  # warm-up: compile, page cache
            lynxkv.save_cache(paths[name], kv, scheme)
            lynxkv.open_cache(paths[name]).load_kv(anchor_only=True)
        for _ in range(args.repeats):
            for name, scheme in schemes.items():
                path = paths[name]
                samples[name, "save_cache"].append(timed(lambda: lynxkv.save_cache(path, kv, scheme)))
                samples[name, "load_kv"].append(timed(lambda: lynxkv.open_cache(path).load_kv()))
                samples[name, "load_anchor"].append(timed(lambda: lynxkv.open_cache(path).load_kv(anchor_only=True)))
                samples[name, "progressive_anchor"].append(timed(lambda: progressive_anchor(path)))
    load1 = os.getloadavg()
    print(f"{args.layers} layers x K,V [8, 4096, 128] bf16, {args.repeats} repeats, load average "
          f"{load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"  {'step':<20}" + "".join(f"{name + ' wall / cpu s':>34}" for name in schemes)
          + f"{'rotated / not, cpu':>22}")
    for step in steps:
        med = {name: (statistics.median(w for w, _ in samples[name, step]),
                      statistics.median(c for _, c in samples[name, step])) for name in schemes}
        (rw, rc), (nw, nc) = med.values()
        print(f"  {step:<20}" + "".join(f"{w:>24.3f} / {c:.3f}" for w, c in med.values()) + f"{rc / nc:>22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
