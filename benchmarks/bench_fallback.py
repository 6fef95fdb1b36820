"""What an install without a C compiler costs: ``lynxkv.save_cache`` (encode and write) and
``lynxkv.open_cache(path).load_kv()`` (read, check and decode to BF16) with the compiled kernels and with the torch
reference they fall back to (``LYNXKV_NATIVE=0``: the same files, the same values).

A Llama-3-8B-shaped BF16 cache (``--layers`` x K,V [8 KV heads, ``--tokens``, 128], synthetic KV-like values;
the default scheme: keys rotated, values per channel), files in a temporary directory (the page cache). Each side
runs in its own process (the switch is read at import), the two alternating for ``--rounds`` rounds; each process
times one warm-up and ``--repeats`` runs and reports its median. The table gives GB/s of BF16 KV (bytes of the
cache / wall seconds), medians with min-max over the rounds, and how many times slower the fallback is.

    python benchmarks/bench_fallback.py               # 5 rounds (a few minutes on 2 cores)
    python benchmarks/bench_fallback.py --rounds 2 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_side(layers: int, tokens: int, repeats: int) -> dict:
    """This process's medians: seconds to save the cache and to load it back."""
    import tempfile

    sys.path.insert(0, str(HERE))
    from bench_codec import synthetic_kv

    import lynxkv
    from lynxkv.quant import fast

    kv = synthetic_kv(layers, 8, tokens, 128)
    pairs = list(zip(kv[0::2], kv[1::2]))
    times = {"save_cache": [], "load_kv": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.lynx"
        for i in range(repeats + 1):  # the first run warms up
            t = time.perf_counter()
            lynxkv.save_cache(path, pairs)
            saved = time.perf_counter() - t
            t = time.perf_counter()
            with lynxkv.open_cache(path) as cache:
                cache.load_kv()
            loaded = time.perf_counter() - t
            if i:
                times["save_cache"].append(saved)
                times["load_kv"].append(loaded)
    return {"compiled": fast.available(), "bytes": sum(x.numel() * 2 for x in kv),
            **{k: statistics.median(v) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--side", choices=["run"], help=argparse.SUPPRESS)  # a child process: print its JSON
    ap.add_argument("--json", type=Path, help="write every round here")
    args = ap.parse_args(argv)
    if args.side:
        print(json.dumps(one_side(args.layers, args.tokens, args.repeats)))
        return 0
    sides = {"compiled": {}, "torch reference": {"LYNXKV_NATIVE": "0"}}
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, env in sides.items():
            done = subprocess.run([sys.executable, __file__, "--side", "run", "--layers", str(args.layers),
                                   "--tokens", str(args.tokens),
                                   "--repeats", str(args.repeats)], env={**os.environ, **env}, capture_output=True,
                                  text=True, check=True)
            result = json.loads(done.stdout)
            if result["compiled"] != (name == "compiled"):
                raise SystemExit(f"{name}: the compiled kernels are {'' if result['compiled'] else 'not '}here")
            rounds[name].append(result)
    print(f"{args.layers} layers x K,V [8, {args.tokens}, 128] bf16; GB/s of BF16 KV, medians (min–max) of "
          f"{args.rounds} rounds")
    print(f"{'path':<18} {'save_cache':>20} {'load_kv':>20}")
    medians = {}
    for name, results in rounds.items():
        cells = []
        for step in ("save_cache", "load_kv"):
            rates = [r["bytes"] / r[step] / 1e9 for r in results]
            medians[(name, step)] = statistics.median(rates)
            cells.append(f"{statistics.median(rates):.3f} ({min(rates):.3f}–{max(rates):.3f})")
        print(f"{name:<18} {cells[0]:>20} {cells[1]:>20}")
    for step in ("save_cache", "load_kv"):
        print(f"torch reference / compiled, {step}: "
              f"{medians[('compiled', step)] / medians[('torch reference', step)]:.0f}x slower")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
