"""Peak memory of `lynxkv verify` / `decode` on two hostile caches that declare the same large shape.

- ``bomb``: every page is a zstd frame that would inflate 64x past its record (tiny on disk);
- ``honest``: all-zero KV whose zstd pages decode to exactly what the header declares (~1000x smaller on disk).

Each command runs in a fresh interpreter; the table gives its exit code and max RSS, and how much above the
interpreter's own (``import lynxkv.cli`` alone) that is, as a multiple of the declared fp32 output size.

    python benchmarks/hostile_memory.py [--layers 8 --heads 8 --tokens 4096 --dim 128]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = ("import resource, sys\nfrom lynxkv.cli import main\ncode = main(sys.argv[1:]) if sys.argv[1:] else 0\n"
         "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, code)\n")


def build(d: str, layers: int, heads: int, tokens: int, dim: int) -> None:
    import torch
    import zstandard

    import lynxkv.format.records as records
    from lynxkv.cache import encode_kv
    from lynxkv.format.writer import build_files

    enc = encode_kv([(torch.zeros(heads, tokens, dim), torch.zeros(heads, tokens, dim)) for _ in range(layers)])
    for name in ("honest", "bomb"):
        if name == "bomb":
            records.compress = lambda raw, codec, level=3: zstandard.ZstdCompressor(
                level=19, write_content_size=False).compress(bytes(len(raw) * 64))
        b = build_files(enc, residual_location=f"{name}.lynxr", zstd=True)
        with open(os.path.join(d, f"{name}.lynx"), "wb") as f:
            f.write(b.anchor)
        with open(os.path.join(d, f"{name}.lynxr"), "wb") as f:
            f.write(b.residual)


def peak(args: list[str]) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("MAXRSS")][-1].split()
    return int(line[1]) * 1024, int(line[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    for k, v in (("layers", 8), ("heads", 8), ("tokens", 4096), ("dim", 128)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--build", help=argparse.SUPPRESS)  # internal: write the two caches into this directory
    a = ap.parse_args()
    if a.build:
        build(a.build, a.layers, a.heads, a.tokens, a.dim)
        return
    declared = 2 * a.layers * a.heads * a.tokens * a.dim * 4
    with tempfile.TemporaryDirectory() as d:
        # Built in a child: Linux carries a parent's peak RSS into the children it forks, so this process stays
        # small (no torch) and every measured child starts from a clean slate.
        subprocess.run([sys.executable, __file__, "--build", d, "--layers", str(a.layers), "--heads", str(a.heads),
                        "--tokens", str(a.tokens), "--dim", str(a.dim)], check=True)
        base, _ = peak([])
        print(f"declared fp32 output {declared / 1e9:.2f} GB; interpreter alone {base / 1e6:.0f} MB")
        print(f"{'cache':8} {'on disk':>10} {'command':28} {'exit':>4} {'max RSS':>10} {'above interp.':>14}")
        for name in ("bomb", "honest"):
            path = os.path.join(d, f"{name}.lynx")
            disk = os.path.getsize(path) + os.path.getsize(path + "r")
            for label, cmd in (("verify", ["verify", path]),
                               ("decode --anchor-only", ["decode", path, "--anchor-only", "-o", f"{path}.a.st"]),
                               ("decode --dtype fp32", ["decode", path, "--dtype", "fp32", "-o", f"{path}.f.st"])):
                rss, code = peak(cmd)
                print(f"{name:8} {disk / 1e3:8.1f} kB {label:28} {code:4d} {rss / 1e6:7.0f} MB "
                      f"{(rss - base) / declared:10.2f} x decl.")


if __name__ == "__main__":
    main()
