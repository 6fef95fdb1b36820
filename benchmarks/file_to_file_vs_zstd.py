"""lynxkv's file-to-file commands against zstd on the same dump: ``lynxkv encode`` against ``zstd -1 -T1``,
``lynxkv decode -o`` and ``lynxkv verify`` against ``zstd -d``, each a fresh process under ``/usr/bin/time``
(wall clock, peak RSS), interleaved over the repeats; prints each command's median (min–max) and the paired
ratios zstd wall / lynxkv wall (above 1: lynxkv is faster). The dump is a Llama-3-8B-shaped BF16 one of random
normal values (benchmarks/big_dump.py, 4.29 GB at the default 32,768 tokens), written once into DIR (kept and
reused when it is there); the disk holds the dump, the cache, the .zst and one decoded file (~15 GB).

    python benchmarks/file_to_file_vs_zstd.py DIR [--tokens 32768] [--layers 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

from lynxkv.bench.timed import run_timed

ROOT = pathlib.Path(__file__).resolve().parent.parent


def timed(argv: list[str], cwd: pathlib.Path) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command, which must succeed."""
    t = run_timed(argv, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return t.wall_s, t.peak_mib


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}–{format(max(xs), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    d = pathlib.Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    dump = d / "kv.safetensors"
    if not dump.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "big_dump.py"), str(dump), "--layers",
                        str(a.layers), "--tokens", str(a.tokens)], check=True)
    lynxkv = [sys.executable, "-m", "lynxkv"]
    zstd = shutil.which("zstd") or sys.exit("needs the zstd command")
    commands = {  # in the order each repeat runs them
        "lynxkv encode": lynxkv + ["encode", "kv.safetensors", "-o", "c.lynx"],
        "zstd -1 -T1": [zstd, "-q", "-1", "-T1", "-f", "kv.safetensors", "-o", "kv.safetensors.zst"],
        "lynxkv decode -o": lynxkv + ["decode", "c.lynx", "-o", "back.safetensors", "--force"],
        "zstd -d": [zstd, "-q", "-d", "-f", "kv.safetensors.zst", "-o", "kv.back"],
        "lynxkv verify": lynxkv + ["verify", "c.lynx"],
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for r in range(a.repeats):
        for name, argv in commands.items():
            if name == "lynxkv encode":  # a fresh cache each time, not the replacement of one
                for old in d.glob("c*.lynx*"):
                    old.unlink()
            runs[name].append(timed(argv, d))
            for leftover in ("back.safetensors", "kv.back"):  # one decoded file on the disk at a time
                (d / leftover).unlink(missing_ok=True)
            print(f"repeat {r + 1}: {name}: {runs[name][-1][0]:.1f} s, {runs[name][-1][1]:.0f} MiB", flush=True)
    size = dump.stat().st_size
    print(f"\ndump: {size / 1e9:.2f} GB; cache {sum((d / n).stat().st_size for n in ('c.lynx', 'c.lynxr')) / 1e9:.2f}"
          f" GB; zstd -1 {(d / 'kv.safetensors.zst').stat().st_size / 1e9:.2f} GB; {a.repeats} repeats, interleaved")
    print(f"{'command':<18} {'wall s, median (min–max)':<28} {'GB/s of the dump':<18} peak RSS MiB")
    for name, rs in runs.items():
        walls = [w for w, _ in rs]
        print(f"{name:<18} {spread(walls, '.1f'):<28} {size / 1e9 / statistics.median(walls):<18.2f} "
              f"{spread([m for _, m in rs], '.0f')}")
    print("\nzstd wall / lynxkv wall, paired by repeat, median (min–max):")
    for ours, theirs, target in (("lynxkv encode", "zstd -1 -T1", 1), ("lynxkv decode -o", "zstd -d", 1),
                                 ("lynxkv verify", "zstd -d", 2)):
        ratios = [t[0] / o[0] for o, t in zip(runs[ours], runs[theirs])]
        print(f"  {theirs} / {ours}: {spread(ratios, '.2f')} (target ≥ {target})")


if __name__ == "__main__":
    main()
