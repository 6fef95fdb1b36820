"""The exact tier: anchor + residual + exact against the raw bytes and zstd of the same tensors.

Usage: python benchmarks/bench_exact.py [--tokens N] [--repeats N] [--threads N] [--no-model]

Two bf16 caches: the KV of the offline SmolLM2 prefilled in bf16 on the built-in prompt of ``--tokens`` tokens
(default 1000; about 30 s to load and prefill), and a Llama-shaped random-ish cache (8 layers x 8 KV heads x
``--tokens`` x 128: Gaussian values with log-normal per-channel scales, the keys with a few 8x outlier
channels). Everything goes through the public API (``save_cache(..., exact=True)``, ``open_cache(...).load_kv``).
It prints, per cache, the bytes of each segment and of zstd-1 / zstd-3 of the raw tensors (one frame per tensor)
and the speeds, medians of ``--repeats`` (default 3) interleaved runs:

- encode: the exact segment's share of ``save_cache`` (with the exact segment minus without), as MB/s of raw
  bf16, beside zstd-1's compression of the raw tensors;
- decode: ``load_kv(exact=True)`` (the whole cache, bf16 bit for bit), beside zstd-1's decompression of the raw
  tensors.

Then the candidates measured for coding the remainder (sizes only), on the same caches. ``--threads`` sets
torch's intra-op threads (default 1: the figures in docs/format.md came from a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zstandard

from lynxkv.cache import open_cache, save_cache
from lynxkv.quant.remainder import remainder_planes


def smollm2_kv(tokens: int):
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prefill import prefill
    from lynxkv.hf.prompts import builtin_prompt

    loaded = load_model(None, dtype=torch.bfloat16)
    ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, tokens))
    kv, _ = prefill(loaded.model, ids)
    return [(k.contiguous(), v.contiguous()) for k, v in kv]


def llama_like_kv(tokens: int, layers: int = 8, heads: int = 8, dim: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = []
    for _ in range(layers):
        scale = torch.exp(0.5 * torch.randn(heads, 1, dim, generator=g))
        kscale = scale.clone()
        kscale[:, :, torch.randint(0, dim, (4,), generator=g)] *= 8  # outlier key channels
        k = torch.randn(heads, tokens, dim, generator=g) * kscale
        v = torch.randn(heads, tokens, dim, generator=g) * scale
        kv.append((k.to(torch.bfloat16), v.to(torch.bfloat16)))
    return kv


def raw_frames(kv) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for pair in kv for t in pair]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, kv, repeats: int, workdir: Path) -> dict:
    frames = raw_frames(kv)
    raw = sum(map(len, frames))
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    c1 = [z1.compress(f) for f in frames]
    c3 = [z3.compress(f) for f in frames]
    d = zstandard.ZstdDecompressor()
    path, plain = workdir / f"{name}.lynx", workdir / f"{name}-plain.lynx"
    t = {"save_exact": [], "save_plain": [], "z1_c": [], "z1_d": [], "load_exact": [], "load_full": []}
    for _ in range(repeats):  # interleaved
        t["save_plain"].append(median_time(lambda: save_cache(plain, kv), 1))
        t["save_exact"].append(median_time(lambda: save_cache(path, kv, exact=True), 1))
        t["z1_c"].append(median_time(lambda: [z1.compress(f) for f in frames], 1))
        t["z1_d"].append(median_time(lambda: [d.decompress(f) for f in c1], 1))
        with open_cache(path) as cache:
            t["load_exact"].append(median_time(lambda: cache.load_kv(exact=True), 1))
            t["load_full"].append(median_time(lambda: cache.load_kv(), 1))
    med = {k: statistics.median(v) for k, v in t.items()}
    with open_cache(path) as cache:
        info = cache.info
        back = cache.load_kv(exact=True)
        predicted = cache.load_kv()
    exact_ok = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for pa, pb in zip(kv, back) for a, b in zip(pa, pb))
    return dict(name=name, raw=raw, zstd1=sum(map(len, c1)), zstd3=sum(map(len, c3)), anchor=info.anchor_bytes,
                residual=info.residual_bytes, exact=info.exact_bytes, exact_ok=exact_ok, elements=raw // 2,
                exact_encode_s=max(med["save_exact"] - med["save_plain"], 1e-9), save_exact_s=med["save_exact"],
                z1_compress_s=med["z1_c"], z1_decompress_s=med["z1_d"], load_exact_s=med["load_exact"],
                load_full_s=med["load_full"], predicted=predicted)


def candidates(kv, predicted) -> dict[str, int]:
    """Bytes of the remainder coded in each candidate way (all pages of the cache as one stream per tensor)."""
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    out = {"ordered difference, byte planes, zstd-1 (chosen)": 0, "ordered difference, byte planes, zstd-3": 0,
           "ordered difference, interleaved bytes, zstd-1": 0, "XOR of the bits, byte planes, zstd-1": 0,
           "original bits, byte planes, zstd-1 (no prediction)": 0}
    for (k, v), (pk, pv) in zip(kv, predicted):
        for x, p in ((k, pk), (v, pv)):
            planes = remainder_planes(x, p)
            out["ordered difference, byte planes, zstd-1 (chosen)"] += len(z1.compress(planes.numpy().tobytes()))
            out["ordered difference, byte planes, zstd-3"] += len(z3.compress(planes.numpy().tobytes()))
            out["ordered difference, interleaved bytes, zstd-1"] += len(z1.compress(planes.t().contiguous().numpy().tobytes()))
            xor = (x.contiguous().view(torch.int16) ^ p.contiguous().view(torch.int16)).view(torch.uint8).view(-1, 2)
            out["XOR of the bits, byte planes, zstd-1"] += len(z1.compress(xor.t().contiguous().numpy().tobytes()))
            bits = x.contiguous().view(torch.uint8).view(-1, 2)
            out["original bits, byte planes, zstd-1 (no prediction)"] += len(z1.compress(bits.t().contiguous().numpy().tobytes()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-model", action="store_true", help="skip SmolLM2 (only the Llama-shaped cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caches = [] if args.no_model else [("SmolLM2 bf16", smollm2_kv(args.tokens))]
    caches.append(("Llama-shaped bf16", llama_like_kv(args.tokens)))
    mb = 1e6
    with tempfile.TemporaryDirectory() as d:
        rows = [(measure(name.split()[0], kv, args.repeats, Path(d)), name, kv) for name, kv in caches]
    print(f"sizes (bytes; ratio to the raw bf16 bytes), {args.tokens} tokens, torch threads {args.threads}")
    print(f"{'cache':<20} {'raw':>12} {'zstd-1':>18} {'zstd-3':>18} {'anchor+residual':>20} {'+exact':>14} "
          f"{'A+R+E':>20} {'bits/el':>8} exact?")
    for r, name, _ in rows:
        total = r["anchor"] + r["residual"] + r["exact"]
        f = lambda n: f"{n:,} ({n / r['raw']:.3f})"  # noqa: E731
        print(f"{name:<20} {r['raw']:>12,} {f(r['zstd1']):>18} {f(r['zstd3']):>18} "
              f"{f(r['anchor'] + r['residual']):>20} {r['exact']:>14,} {f(total):>20} "
              f"{8 * total / r['elements']:>8.2f} {'bit-identical' if r['exact_ok'] else 'MISMATCH'}")
    print("\nspeeds (MB/s of raw bf16, medians of", args.repeats, "interleaved runs)")
    print(f"{'cache':<20} {'exact encode':>13} {'zstd-1 comp':>12} {'ratio':>6} | {'decode exact':>13} "
          f"{'zstd-1 decomp':>14} {'ratio':>6} | {'save_cache+exact':>16} {'load_kv full':>13}")
    for r, name, _ in rows:
        s = lambda sec: r["raw"] / sec / mb  # noqa: E731
        print(f"{name:<20} {s(r['exact_encode_s']):>13.0f} {s(r['z1_compress_s']):>12.0f} "
              f"{r['z1_compress_s'] / r['exact_encode_s']:>6.2f} | {s(r['load_exact_s']):>13.0f} "
              f"{s(r['z1_decompress_s']):>14.0f} {r['z1_decompress_s'] / r['load_exact_s']:>6.2f} | "
              f"{s(r['save_exact_s']):>16.0f} {s(r['load_full_s']):>13.0f}")
    print("\ncandidates for the remainder (bytes of the exact payload alone; bits per element)")
    for r, name, kv in rows:
        for cand, n in candidates(kv, r["predicted"]).items():
            print(f"{name:<20} {cand:<52} {n:>12,} {8 * n / r['elements']:>6.2f}")


if __name__ == "__main__":
    main()
