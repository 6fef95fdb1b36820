"""Check, with memory bounded by one layer, that a decoded safetensors file holds exactly the cache's own values:
its tensors in file order against ``open_cache(cache).iter_layers()`` (keys, then values, layer by layer), bit for
bit. What the "caches larger than memory" run uses instead of holding either copy.

    python benchmarks/check_decoded.py c.lynx back.safetensors [--anchor-only]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lynxkv import open_cache  # noqa: E402

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache")
    ap.add_argument("decoded")
    ap.add_argument("--anchor-only", action="store_true")
    a = ap.parse_args()
    with open(a.decoded, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    entries = sorted(header.values(), key=lambda e: e["data_offsets"][0])
    data = np.memmap(a.decoded, dtype=np.uint8, mode="r", offset=8 + n)
    with open_cache(a.cache) as c:
        layers = c.iter_layers(anchor_only=a.anchor_only, window=1)
        tensors = (t for k, v in layers for t in (k, v))
        for i, entry in enumerate(entries):
            want = next(tensors)
            lo, hi = entry["data_offsets"]
            got = torch.from_numpy(np.array(data[lo:hi])).view(DTYPES[entry["dtype"]]).view(entry["shape"])
            if not torch.equal(got, want.to(got.dtype).reshape(got.shape)):
                print(f"tensor {i}: differs", file=sys.stderr)
                return 1
        if next(tensors, None) is not None:
            print("the file has fewer tensors than the cache", file=sys.stderr)
            return 1
    print(f"{len(entries)} tensors equal, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
