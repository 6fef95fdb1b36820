"""The page checksum: lynxkv's compiled CRC-32 (``lynxkv/format/_crc.c``, carry-less multiplication) against
``zlib.crc32`` (the same CRC-32/ISO-HDLC value), alone and on the user path.

In one process, each figure measured with the compiled checksum and with zlib's alternately (interleaved
rounds), medians with min-max over ``--repeats`` rounds:

- ``crc32 <size>``: GB/s of one checksum call over a buffer of that size: 4 KiB (a header or index), the stored
  page records of the cache below (anchor and residual pages of a layer's keys or values: ``P`` tokens x heads x
  head_dim / 2 codes, plus the anchor's metadata), and 1 MiB;
- ``load_kv``: ``lynxkv.open_cache(path).load_kv()`` of a synthetic Llama-3-8B-shaped BF16 cache (every page read,
  checked and decoded; wall and process CPU seconds);
- ``verify``: ``lynxkv.verify_file(path)`` (structure and every checksum of both segments, nothing decoded).

The zlib side switches the module's compiled checksum off for its round (what a build without a C compiler runs).

    python benchmarks/bench_checksum.py                   # 8 layers x 8 heads x 4,096 tokens x 128, 7 rounds
    python benchmarks/bench_checksum.py --layers 2 --repeats 3   # seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codec import synthetic_kv  # noqa: E402 - the benchmarks share one synthetic KV generator

import lynxkv  # noqa: E402
from lynxkv.format import checksum  # noqa: E402

SIDES = ("compiled", "zlib")


def _rate(fn, data, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(data)
    return len(data) * calls / (time.perf_counter() - t) / 1e9


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def page_sizes(path: Path, residual: Path, pages: int) -> tuple[int, int]:
    """The mean stored bytes of an anchor and of a residual page record (file length / pages, headers and index
    included: within a percent at these sizes)."""
    return path.stat().st_size // pages, residual.stat().st_size // pages


def run(layers: int, heads: int, tokens: int, dim: int, repeats: int, tmp: Path) -> dict:
    if checksum._CRC is None:  # noqa: SLF001 - the benchmark compares the two paths of one module
        raise SystemExit("the compiled checksum is not built (no C compiler at install): nothing to compare")
    kv = synthetic_kv(layers, heads, tokens, dim)
    path, residual = tmp / "bench.lynx", tmp / "bench.lynxr"
    lynxkv.save_cache(path, list(zip(kv[0::2], kv[1::2])))
    pages = 2 * layers * -(-tokens // 256)
    anchor_page, residual_page = page_sizes(path, residual, pages)
    rng = np.random.default_rng(0)
    sizes = {"4 KiB": 4096, f"anchor page ({anchor_page} B)": anchor_page,
             f"residual page ({residual_page} B)": residual_page, "1 MiB": 1 << 20}
    buffers = {name: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for name, n in sizes.items()}
    compiled = checksum._CRC  # noqa: SLF001
    samples: dict[str, dict[str, list[float]]] = {}

    def add(name: str, side: str, value: float) -> None:
        samples.setdefault(name, {s: [] for s in SIDES}).setdefault(side, []).append(value)

    cache = lynxkv.open_cache(path)
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for side in SIDES:
            checksum._CRC = compiled if side == "compiled" else None  # noqa: SLF001
            for name, data in buffers.items():
                add(f"crc32 {name} GB/s", side, _rate(checksum.crc32, data, max(1, (1 << 26) // len(data))))
            wall, cpu = _timed(cache.load_kv)
            add("load_kv s", side, wall)
            add("load_kv cpu s", side, cpu)
            wall, cpu = _timed(lambda: lynxkv.verify_file(path))
            add("verify s", side, wall)
            add("verify cpu s", side, cpu)
    checksum._CRC = compiled  # noqa: SLF001
    for per_side in samples.values():
        for values in per_side.values():
            del values[0]
    assert zlib.crc32(buffers["1 MiB"]) == checksum.crc32(buffers["1 MiB"])
    return {"shape": [layers, heads, tokens, dim], "bf16_bytes": sum(x.numel() * 2 for x in kv),
            "samples": samples, "machine": platform.processor() or platform.machine(),
            "zlib": zlib.ZLIB_RUNTIME_VERSION}


def summary(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="write every sample here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.layers, args.heads, args.tokens, args.dim, args.repeats, Path(tmp))
    print(f"cache {args.layers} layers x K,V [{args.heads}, {args.tokens}, {args.dim}] bf16 = "
          f"{result['bf16_bytes'] / 1e6:.0f} MB; zlib {result['zlib']}; medians (min–max) of {args.repeats} rounds")
    print(f"{'figure':<36} {'compiled':>22} {'zlib.crc32':>22}")
    for name, per_side in result["samples"].items():
        digits = 2 if "GB/s" in name else 3
        print(f"{name:<36} {summary(per_side['compiled'], digits):>22} {summary(per_side['zlib'], digits):>22}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
