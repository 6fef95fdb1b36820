"""A prompt's prefix loaded progressively from an LMCache store (lynx tier) against the same cache as one file.

Run in the LMCache venv (``make test-lmcache`` builds it)::

    .venv-lmcache/bin/python benchmarks/lmcache_prefix.py --chunks 16 --bandwidth 200Mbps --repeats 3

It stores ``--chunks`` synthetic 256-token chunks through LMCache's own serde factory and the lynx tier (keys from
LMCache's token hasher), saves the joined prefix once as a plain two-file cache (``lynxkv stream -o``'s copy),
then loads both with ``open_progressive`` on the same emulated link, alternating, and prints the medians of
anchor-ready and residual-ready (dequantized KV ready, as ``lynxkv run`` needs it) and their ratio. Default
shape: SmolLM2-135M's (30 layers, 3 KV heads x 64).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys  # noqa: E402
from lmcache.v1.multiprocess.token_hasher import TokenHasher  # noqa: E402

from lynxkv.integrations.lmcache.adapter import LynxL2Adapter  # noqa: E402
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream import open_progressive  # noqa: E402
from lynxkv.stream.received import ReceivedCopy  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def memobj(t: torch.Tensor) -> TensorMemoryObj:
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    return TensorMemoryObj(raw, MemoryObjMetadata(t.shape, t.dtype, 0, raw.numel(), 1), None)


def wait(poll):
    while (r := poll()) is None or r == {}:
        time.sleep(0.005)
    return r


def build_store(root: str, chunks: int, layers: int, heads: int, dim: int) -> str:
    tokens = torch.randint(0, 49_152, (chunks * 256,), generator=torch.Generator().manual_seed(0)).tolist()
    keys, _ = resolve_object_keys(TokenHasher(), MODEL, 1, tokens, "")
    shape = (2, layers, 256, heads * dim)
    serde = create_serde_processor(SerdeConfig("lynx", {"kv_heads": heads}))
    tier = LynxL2Adapter({"anchor_path": f"{root}/hot", "residual_path": f"{root}/cold"})
    size = serde.estimate_serialized_size(MemoryLayoutDesc([torch.Size(shape)], [torch.float16]))
    g = torch.Generator().manual_seed(1)
    try:
        for key in keys:  # one chunk at a time: bounded memory
            src = memobj(torch.randn(shape, generator=g).to(torch.float16))
            tmp = memobj(torch.zeros(size, dtype=torch.uint8))
            sid = serde.submit_serialize([src], [tmp], [key])
            assert wait(lambda: serde.query_serialize_result(sid))
            tid = tier.submit_store_task([key], [tmp])
            assert wait(tier.pop_completed_store_tasks)[tid].is_successful()
    finally:
        tier.close()
        serde.close()
    return (f"lmcache://{MODEL}?anchor_path={root}/hot&residual_path={root}/cold"
            f"&tokens={','.join(map(str, tokens))}")


def timed(source: str, bandwidth: str) -> tuple[float, float]:
    with open_progressive(source, link=link_at(bandwidth)) as load:
        load.residual.result(timeout=600)
        tl = load.timeline
        return tl.anchor_ready_s, tl.residual_ready_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--bandwidth", default="200Mbps")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        url = build_store(root, args.chunks, args.layers, args.kv_heads, args.head_dim)
        print(f"stored {args.chunks} chunks in {time.perf_counter() - t0:.1f} s")
        copy = ReceivedCopy(f"{root}/copy/prefix.lynx")
        with open_progressive(url, decode=False, tee=copy.tee) as load:
            load.residual.result(timeout=600)
            written = copy.commit(load, anchor_only=False)
        sizes = {k: os.path.getsize(v) for k, v in written.items()}
        print(f"prefix as one cache: anchor {sizes['anchor']:,} B, residual {sizes['residual']:,} B")
        timed(url, args.bandwidth)  # warm-up (imports, the hasher)
        rows: dict[str, list[tuple[float, float]]] = {"lmcache://": [], "one file": []}
        for _ in range(args.repeats):
            rows["lmcache://"].append(timed(url, args.bandwidth))
            rows["one file"].append(timed(written["anchor"], args.bandwidth))
    med = {k: (statistics.median(a for a, _ in v), statistics.median(r for _, r in v)) for k, v in rows.items()}
    print(f"\n{args.chunks * 256} tokens, link {args.bandwidth}, medians of {args.repeats}")
    print(f"{'source':<12} {'anchor ready s':>15} {'residual ready s':>17} {'anchor/residual':>16}")
    for k, (a, r) in med.items():
        print(f"{k:<12} {a:>15.3f} {r:>17.3f} {a / r:>16.2f}")
    (la, lr), (fa, fr) = med["lmcache://"], med["one file"]
    print(f"ratio lmcache:// / one file: anchor {la / fa:.2f}, residual {lr / fr:.2f}")


if __name__ == "__main__":
    main()
