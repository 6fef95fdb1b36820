"""GPU benchmark: fused Triton encode and decode against a device-to-device copy, in one run.

A Llama-3-8B-shaped cache (32 layers, K and V, 8 KV heads, head_dim 128) of synthetic KV-like BF16 values is
held as one ``[64, 8, T, 128]`` tensor (each batch item is one layer's keys or values), so each operation is
one launch over the whole cache. Times are medians of ``triton.testing.do_bench``.

Two rates are printed per operation:

- ``BF16 GB/s``: bytes of the BF16 cache processed per second (what a transfer pipeline sees);
- ``traffic GB/s``: bytes actually read + written per second (copy: 2 x BF16; encode: BF16 in, ~0.53 x out;
  decode the reverse), to compare with the copy's, which is the memory-bandwidth ceiling.

    PYTHONPATH=... python benchmarks/bench_gpu.py --tokens 8192 --json out/gpu_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


def kv_like(n: int, heads: int, tokens: int, dim: int, device: str, seed: int = 0) -> torch.Tensor:
    """Per-channel offsets and scales, a few outlier channels, smooth along tokens: KV-like statistics."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((n, heads, tokens, dim), generator=g, device=device, dtype=torch.bfloat16)
    ch_scale = torch.rand((n, heads, 1, dim), generator=g, device=device) * 2 + 0.1
    ch_scale[..., :4] *= 15.0  # outlier channels
    ch_off = torch.randn((n, heads, 1, dim), generator=g, device=device) * 0.5
    x.mul_(ch_scale.to(torch.bfloat16)).add_(ch_off.to(torch.bfloat16))
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench measuring time per operation")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="check the script's logic on a CPU under TRITON_INTERPRET=1 (tiny sizes, wall-clock timing)")
    args = ap.parse_args(argv)
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA device", file=sys.stderr)
        return 2
    import triton

    from lynxkv.kernels import decode as kdecode
    from lynxkv.kernels import encode as kencode
    from lynxkv.quant import pack_bits, quantize
    from lynxkv.quant.scheme import get_scheme

    scheme = get_scheme("linear")  # the Triton kernels implement the linear compander
    dev = "cpu" if args.dry_run_cpu else "cuda"
    card = "CPU (interpreter dry run)" if args.dry_run_cpu else torch.cuda.get_device_name(0)
    sync = (lambda: None) if args.dry_run_cpu else torch.cuda.synchronize
    rows, results = [], {
        "card": card, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "scheme": scheme.describe(), "runs": [],
    }
    for tokens in args.tokens:
        n = 2 * args.layers
        x = kv_like(n, args.heads, tokens, args.head_dim, dev)
        bf16_bytes = x.numel() * 2
        a, r, o, s = kencode.encode(x, scheme)
        meta_bytes = o.numel() * o.element_size() * 2
        code_bytes = a.numel() + r.numel()
        out = torch.empty_like(x)
        copy_dst = torch.empty_like(x)

        # correctness on the GPU at full size: one layer against the CPU reference, the round trip everywhere
        probe = min(5, n - 1)  # one layer checked bit for bit against the CPU reference
        ref = quantize(x[probe].cpu(), scheme)
        exact = bool(torch.equal(a[probe].cpu(), pack_bits(ref.anchor, 4)) and torch.equal(r[probe].cpu(), pack_bits(ref.residual, 4))
                     and torch.equal(o[probe].cpu(), ref.offset) and torch.equal(s[probe].cpu(), ref.scale))
        kdecode.decode(a, r, o, s, scheme, out)
        round_trip_ok = True
        for i in range(n):  # one batch item at a time: fp32 temporaries of the whole 32K cache would not fit beside it
            step = (s[i].float() / 120.0).repeat_interleave(scheme.chunk, 1)[:, :tokens]
            xi = x[i].float()
            round_trip_ok &= bool(((out[i].float() - xi).abs() <= step * 1.01 + 2.0**-7 * xi.abs()).all())
        del step, xi

        def bench(fn):
            if args.dry_run_cpu:
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
                return statistics.median(times)
            from triton.testing import do_bench

            return do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median")  # ms

        t_copy = bench(lambda: copy_dst.copy_(x))
        t_enc = bench(lambda: kencode.encode(x, scheme, check_finite=False))
        t_dec = bench(lambda: kdecode.decode(a, r, o, s, scheme, out))
        t_dec_a = bench(lambda: kdecode.decode(a, None, o, s, scheme, out))
        # the torch reference on the GPU, for scale (one layer-batch view, a few runs)
        flat = x.view(n * args.heads, tokens, args.head_dim)
        try:
            ref_times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                q = quantize(flat, scheme)
                pack_bits(q.anchor, 4), pack_bits(q.residual, 4)
                sync()
                ref_times.append((time.perf_counter() - t0) * 1e3)
                del q
            t_ref = statistics.median(ref_times)
        except Exception as exc:  # noqa: BLE001 - a reference failure (memory) must not lose the kernel numbers
            print(f"reference on GPU skipped: {exc}", file=sys.stderr)
            t_ref = float("nan")

        def rate(nbytes, ms):
            return nbytes / (ms * 1e-3) / 1e9

        copy_traffic = rate(2 * bf16_bytes, t_copy)
        ops = [
            ("device copy", t_copy, 2 * bf16_bytes),
            ("encode (fused Triton)", t_enc, bf16_bytes + code_bytes + meta_bytes),
            ("decode full (fused Triton)", t_dec, code_bytes + meta_bytes + bf16_bytes),
            ("decode anchor (fused Triton)", t_dec_a, code_bytes // 2 + meta_bytes + bf16_bytes),
            ("torch reference quantize+pack", t_ref, float("nan")),
        ]
        for name, ms, traffic in ops:
            row = {
                "tokens": tokens, "op": name, "ms": ms, "bf16_GBps": rate(bf16_bytes, ms),
                "traffic_GBps": rate(traffic, ms) if traffic == traffic else None,
                "traffic_vs_copy": rate(traffic, ms) / copy_traffic if traffic == traffic else None,
            }
            rows.append(row)
        results["runs"].append({
            "tokens": tokens, "shape": list(x.shape), "bf16_bytes": bf16_bytes, "code_bytes": code_bytes,
            "meta_bytes": meta_bytes, "bit_exact_vs_reference": exact, "round_trip_within_step": round_trip_ok,
        })
        print(f"[{card}] tokens={tokens} shape={list(x.shape)} BF16 {bf16_bytes / 1e9:.3f} GB -> codes "
              f"{code_bytes / 1e9:.3f} GB + meta {meta_bytes / 1e9:.3f} GB; bit-exact vs reference (batch item {probe}): {exact}; "
              f"round trip within half a step: {round_trip_ok}")
        del x, a, r, o, s, out, copy_dst, flat
        if not args.dry_run_cpu:
            torch.cuda.empty_cache()
    results["rows"] = rows
    header = f"{'tokens':>6}  {'operation':<32} {'ms':>9} {'BF16 GB/s':>10} {'traffic GB/s':>13} {'vs copy':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        tr = "" if row["traffic_GBps"] is None else f"{row['traffic_GBps']:13.0f}"
        vs = "" if row["traffic_vs_copy"] is None else f"{row['traffic_vs_copy'] * 100:7.0f}%"
        print(f"{row['tokens']:>6}  {row['op']:<32} {row['ms']:9.3f} {row['bf16_GBps']:10.0f} {tr:>13} {vs:>8}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    ok = all(run["bit_exact_vs_reference"] and run["round_trip_within_step"] for run in results["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
