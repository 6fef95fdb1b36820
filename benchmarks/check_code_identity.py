"""Exhaustive check of the fast path's code identity over every fp32 ``v`` in ``[0, A]``.

The reference rounds in two steps (``a = floor(v + 0.5)``, ``r = floor((v - a + 0.5)·R)``); the fast CPU path
computes the same 8-bit code from ``w = R·v`` with :func:`lynxkv.quant.fast.code_from_w`. This walks all
~1e9 fp32 bit patterns of ``[0, A]`` in slices (about 30 s per split on 2 cores) and prints the mismatches.

    python benchmarks/check_code_identity.py            # the 4+4 split
    python benchmarks/check_code_identity.py 3 5 6      # other anchor widths
"""

from __future__ import annotations

import sys
import time

import torch

from lynxkv.quant.fast import code_from_w


def check(anchor_bits: int, step: int = 1 << 24) -> int:
    residual_bits = 8 - anchor_bits
    a_steps, levels = float(2**anchor_bits - 1), float(2**residual_bits)
    top = int(torch.tensor([a_steps], dtype=torch.float32).view(torch.int32))
    bad = 0
    for start in range(0, top + 1, step):
        v = torch.arange(start, min(start + step, top + 1), dtype=torch.int32).view(torch.float32)
        a = torch.clamp(torch.floor(v + 0.5), 0.0, a_steps)
        r = torch.clamp(torch.floor((v - a + 0.5) * levels), 0.0, levels - 1.0)
        ref = a * levels + r
        fast = code_from_w(v * levels, int(levels), torch.empty_like(v))
        miss = ref != fast
        if bool(miss.any()):
            bad += int(miss.sum())
            print(f"  mismatch at v={v[miss][:4].tolist()}: reference {ref[miss][:4].tolist()}, fast {fast[miss][:4].tolist()}")
    return bad


def main() -> int:
    splits = [int(a) for a in sys.argv[1:]] or [4]
    failed = 0
    for bits in splits:
        t0 = time.perf_counter()
        bad = check(bits)
        print(f"{bits}+{8 - bits}: {bad} mismatches over all fp32 v in [0, {2**bits - 1}] ({time.perf_counter() - t0:.0f} s)")
        failed += bad
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
