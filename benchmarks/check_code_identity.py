"""Exhaustive check of the fast CPU path's codes against the reference over every fp32 ``u`` in ``[-1, 1]``.

The code of an element depends only on its normalised value ``u = fl(fl(x - o) / s)``. The reference computes
it with :func:`lynxkv.quant.reference.codes_of_u` (the α-law step in float64); the fast path
(:mod:`lynxkv.quant.fast`) approximates the compander in fp32 and sends every element near a code boundary
through a threshold table built from the reference. This walks all 2,130,706,434 fp32 values of ``[-1, 1]``
through both in slices of 2^24 and prints the mismatches (a few minutes per scheme on 2 cores).

    python benchmarks/check_code_identity.py                    # the default scheme
    python benchmarks/check_code_identity.py default linear paper "default:anchor_bits=5"
"""

from __future__ import annotations

import sys
import time

import torch

from lynxkv.quant import fast, reference
from lynxkv.quant.scheme import get_scheme

KEY_MIN, KEY_MAX = fast.KEY_MIN, fast.KEY_MAX


def parse(spec: str):
    name, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = float(value) if key == "alpha" else (int(value) if value.isdigit() else value)
    return get_scheme(name, **overrides)


def check(scheme, step: int = 1 << 24) -> int:
    bad = 0
    for start in range(KEY_MIN, KEY_MAX + 1, step):
        keys = torch.arange(start, min(start + step, KEY_MAX + 1), dtype=torch.int64)
        u = fast._u_of_key(keys)
        ref = reference.join_code(*reference.codes_of_u(u, scheme), scheme)
        got = reference.join_code(*fast.codes_of_u(u, scheme), scheme)
        miss = ref != got
        if bool(miss.any()):
            bad += int(miss.sum())
            print(f"  mismatch at u={u[miss][:4].tolist()}: reference {ref[miss][:4].tolist()}, fast {got[miss][:4].tolist()}")
    return bad


def main() -> int:
    specs = sys.argv[1:] or ["default"]
    failed = 0
    for spec in specs:
        scheme = parse(spec)
        t0 = time.perf_counter()
        bad = check(scheme)
        print(f"{spec} ({scheme.describe()}): {bad} mismatches over every fp32 u in [-1, 1] "
              f"({time.perf_counter() - t0:.0f} s)")
        failed += bad
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
