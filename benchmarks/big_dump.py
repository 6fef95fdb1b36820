"""Write a synthetic KV dump larger than memory, without holding it: a Llama-3-8B-shaped safetensors file (default
32 layers x 8 KV heads x 32,768 tokens x 128 in BF16, 4.29 GB) whose header is written first and then each layer's
random normal keys and values, one layer at a time (:func:`lynxkv.cache.dumps.write_kv_safetensors`). It is the
input of the "Caches larger than memory" measurement in docs/performance.md:

    python benchmarks/big_dump.py kv.safetensors [--layers 32 --heads 8 --tokens 32768 --dim 128] [--dtype bf16]
    /usr/bin/time -v lynxkv encode kv.safetensors -o c.lynx
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lynxkv.cache.dumps import write_kv_safetensors  # noqa: E402
from lynxkv.cache.kv import TORCH_DTYPES  # noqa: E402


def layers(n: int, shape: tuple[int, int, int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shape, dtype = (a.heads, a.tokens, a.dim), TORCH_DTYPES[a.dtype]
    write_kv_safetensors(a.output, layers(a.layers, shape, dtype, a.seed), layers=a.layers, shape=shape, dtype=dtype)
    size = pathlib.Path(a.output).stat().st_size
    print(f"wrote {a.output}: {a.layers} layers x {a.heads} x {a.tokens} x {a.dim} {a.dtype}, {size:,} bytes")


if __name__ == "__main__":
    main()
