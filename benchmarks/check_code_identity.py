"""Exhaustive check of the fast CPU path's codes against the reference over every fp32 ``u`` in ``[-1, 1]``.

The code of an element depends only on its normalised value ``u = fl(fl(x - o) / s)``. The reference computes
it with :func:`lynxkv.quant.reference.codes_of_u` (the α-law step in float64); the fast path
(:mod:`lynxkv.quant.fast`) looks every code up in a bucket table built from the reference (the AVX2 encode), or
(the portable loops, ``--portable``; what runs on a CPU without AVX2) approximates the compander in fp32 and
sends every element near a code boundary through that table. This walks all 2,130,706,434 fp32 values of
``[-1, 1]`` through both in slices of 2^24 and prints the mismatches (a few minutes per scheme on 2 cores).

The key rotation (the default's) happens before ``u``: it changes which ``u`` a key has, not the
code of a ``u``, so this check covers a rotating scheme as it covers any other. The rotation itself is checked
separately (``--rotation``): the fused CPU decode and, where Triton imports (a GPU, or ``TRITON_INTERPRET=1``),
the Triton decode rotate back bit for bit as the reference does, on random and adversarial key rows (bf16 and
fp32 inputs; head_dim 64, 128, 96 (blocks of 32), 80 (blocks of 16), 1 (the identity)), in seconds.

    python benchmarks/check_code_identity.py                    # the default scheme
    python benchmarks/check_code_identity.py default linear paper "default:anchor_bits=5"
    python benchmarks/check_code_identity.py --portable default  # the portable loops, where the CPU has AVX2
    python benchmarks/check_code_identity.py --rotation         # the key rotation's decode paths
"""

from __future__ import annotations

import os
import sys
import time

import torch

from lynxkv.quant import c_kernels, fast, reference, tables
from lynxkv.quant.scheme import get_scheme

KEY_MIN, KEY_MAX = tables.KEY_MIN, tables.KEY_MAX


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
        u = tables.u_of_key(keys)
        ref = reference.join_code(*reference.codes_of_u(u, scheme), scheme)
        got = reference.join_code(*fast.codes_of_u(u, scheme), scheme)
        miss = ref != got
        if bool(miss.any()):
            bad += int(miss.sum())
            print(f"  mismatch at u={u[miss][:4].tolist()}: reference {ref[miss][:4].tolist()}, fast {got[miss][:4].tolist()}")
    return bad


def rotation_rows(d: int, seed: int) -> torch.Tensor:
    """``[2, 96, d]`` keys: KV-like rows with outlier channels, and adversarial ones (cancelling sums, subnormal
    intermediates, magnitudes 2^-20 ... 2^20 side by side, signed zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 96, d, generator=g) * (torch.rand(d, generator=g) * 3 + 0.05)
    x[..., : max(1, d // 16)] *= 20.0
    x[0, 10] = torch.tensor([(-1.0) ** i * 2.0**12 for i in range(d)])
    x[0, 11] = 2.0**-120
    x[1, 12] = torch.randn(d, generator=g) * 2.0 ** torch.randint(-20, 21, (d,), generator=g).float()
    x[1, 13] = torch.tensor([-0.0 if i % 2 else 0.0 for i in range(d)])
    return x


def check_rotation() -> int:
    """Mismatching elements of the fast and Triton decodes of rotated keys against the reference."""
    from lynxkv import quant

    scheme = get_scheme("default", meta_dtype="fp32")  # rotated keys; fp32 metadata for the wide magnitudes
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    kernels = quant.dispatch._triton() if torch.cuda.is_available() or interpreted else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bad = 0
    for d in (64, 128, 96, 80, 1):
        for dtype in (torch.bfloat16, torch.float32):
            x = rotation_rows(d, d).to(dtype)
            enc = reference.quantize(x, scheme)
            for anchor_only in (False, True):
                for out_dtype in (torch.float32, torch.bfloat16):
                    want = reference.dequantize(enc, scheme, anchor_only=anchor_only, dtype=out_dtype)
                    paths = {"fast": quant.dequantize(enc, scheme, anchor_only=anchor_only, dtype=out_dtype)}
                    if kernels is not None and d % 2 == 0:
                        out = torch.full((1, *x.shape), float("nan"), dtype=out_dtype, device=device)
                        a, r = quant.pack_bits(enc.anchor, 4).to(device), quant.pack_bits(enc.residual, 4).to(device)
                        kernels[1].decode(a.view(1, -1), r.view(1, -1), enc.offset.to(device).unsqueeze(0),
                                          enc.scale.to(device).unsqueeze(0), scheme, out, anchor_only=anchor_only,
                                          sinks=enc.sinks)
                        paths["triton"] = out[0].cpu()
                    for name, got in paths.items():
                        miss = int((got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
                                    != want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)).sum())
                        if miss:
                            print(f"  {name} D={d} {dtype} anchor_only={anchor_only} -> {out_dtype}: {miss} mismatches")
                        bad += miss
    print(f"key rotation: {bad} mismatching elements (fast{', triton' if kernels is not None else ''} against the "
          "reference; head_dim 64, 128, 96, 80, 1)")
    return bad


def main() -> int:
    if sys.argv[1:] == ["--rotation"]:
        return 1 if check_rotation() else 0
    args = sys.argv[1:]
    portable = "--portable" in args
    specs = [a for a in args if a != "--portable"] or ["default"]
    path = "portable loops" if portable or fast.native() == "scalar" else "AVX2 encode"
    failed = 0
    for spec in specs:
        scheme = parse(spec)
        t0 = time.perf_counter()
        c_kernels.NATIVE.lynx_scalar_only(int(portable))
        try:
            bad = check(scheme)
        finally:
            c_kernels.NATIVE.lynx_scalar_only(0)
        print(f"{spec} ({scheme.describe()}; {path}): {bad} mismatches over every fp32 u in [-1, 1] "
              f"({time.perf_counter() - t0:.0f} s)")
        failed += bad
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
