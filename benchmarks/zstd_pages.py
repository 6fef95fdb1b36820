"""Does zstd pay for .lynx pages? Stored bytes of the anchor and residual sections with and without zstd.

Usage: python benchmarks/zstd_pages.py [KV.safetensors] [--scheme NAME]
With no file it prefills the offline SmolLM2 on the built-in ~1000-token prompt (about 20 s).
Prints one row per (scheme, segment): raw bytes, zstd bytes, ratio, and encode/decode times (medians of 3).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lynxkv.cache import encode_kv, open_cache, save_cache
from lynxkv.scheme import get_scheme


def load_kv(path: str | None):
    if path:
        from safetensors.torch import load_file

        t = load_file(path)
        n = len([k for k in t if k.endswith(".key")])
        return [(t[f"layers.{i}.key"], t[f"layers.{i}.value"]) for i in range(n)]
    from lynxkv.models import encode_prompt, load_model, prefill
    from lynxkv.prompts import builtin_prompt

    lm = load_model()
    kv, _ = prefill(lm.model, encode_prompt(lm, builtin_prompt(lm.tokenizer, tokens=1000)))
    return kv


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    path = next((a for a in argv if not a.startswith("--")), None)
    schemes = [argv[argv.index("--scheme") + 1]] if "--scheme" in argv else ["default", "paper"]
    kv = load_kv(path)
    print(f"KV: {len(kv)} layers x {tuple(kv[0][0].shape)} {kv[0][0].dtype}")
    print(f"{'scheme':8} {'segment':9} {'raw B':>10} {'zstd B':>10} {'ratio':>6} {'write raw s':>11} "
          f"{'write zstd s':>12} {'read raw s':>10} {'read zstd s':>11}")
    with tempfile.TemporaryDirectory() as d:
        for name in schemes:
            enc = encode_kv(kv, get_scheme(name))
            res = {}
            for z in (False, True):
                p = Path(d) / f"{name}-{z}.lynx"
                res[z] = save_cache(p, enc, zstd=z)
                res[(z, "w")] = median_time(lambda: save_cache(p, enc, zstd=z))
                with open_cache(p) as c:
                    res[(z, "ra")] = median_time(lambda: c.load_kv(anchor_only=True))
                    res[(z, "rf")] = median_time(lambda: c.load_kv())
            for seg, key, rk in (("anchor", "anchor_payload_bytes", "ra"), ("residual", "residual_payload_bytes", "rf")):
                raw, zs = getattr(res[False], key), getattr(res[True], key)
                print(f"{name:8} {seg:9} {raw:>10} {zs:>10} {raw / zs:>6.3f} {res[(False, 'w')]:>11.3f} "
                      f"{res[(True, 'w')]:>12.3f} {res[(False, rk)]:>10.3f} {res[(True, rk)]:>11.3f}")
            print(f"{name:8} bits/element total {res[False].bits_per_element['total']:.3f} -> "
                  f"{res[True].bits_per_element['total']:.3f}, anchor {res[False].bits_per_element['anchor']:.3f} -> "
                  f"{res[True].bits_per_element['anchor']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
