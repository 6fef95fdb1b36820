"""CPU codec benchmark: lynxkv's fast path side by side with the usual ways of storing a BF16 KV cache.

For each cache (SmolLM2-135M shape: 30 layers x K,V, 3 KV heads, head_dim 64, real KV from the offline model
when ``--real`` or a cached dump is available; Llama-3-8B shape: 32 layers, 8 KV heads, head_dim 128, synthetic
with KV-like statistics) at 1K and 8K tokens, in one run:

- ``copy``: ``tensor.clone()`` of every layer, the memory-bandwidth ceiling;
- ``safetensors``: save the BF16 cache to a file and load it back (to ``--tmp``);
- ``zstd-1`` / ``zstd-3``: lossless compression of the raw BF16 bytes (multi-threaded compress);
- ``int8/token``: a naive per-token absmax INT8 torch quantizer (round, clamp, int8 + fp16 scale);
- ``lynxkv-ref``: the torch reference (``quantize`` + ``pack_bits``; decode = ``unpack_bits`` + ``dequantize``);
- ``lynxkv-fast``: the entry's fused ``quantize_packed`` / ``dequantize_packed`` (the fast CPU path, decode
  into a preallocated BF16 cache),
  and ``lynxkv-anchor``: the anchor-only decode.

Throughputs are GB/s of BF16 KV (bytes of the BF16 cache / wall seconds), medians of ``--repeats`` runs after
one warm-up run; ``GB/cpu-s`` divides by the process CPU time instead (all threads together), which stays
meaningful on a machine shared with other work. Sizes are the stored bytes (payload + metadata) and bits per
element. Prints a table, writes JSON with every sample and the load average.

    python benchmarks/bench_codec.py                 # full run (a few minutes on 2 cores)
    python benchmarks/bench_codec.py --quick         # small shapes, one repeat (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lynxkv.quant import dequantize_packed, quantize_packed
from lynxkv.quant.pack import pack_bits, unpack_bits
from lynxkv.quant.reference import EncodedTensor, dequantize, quantize
from lynxkv.quant.scheme import get_scheme

CACHE_DIR = Path(os.environ.get("LYNXKV_BENCH_CACHE", Path.home() / ".cache" / "lynxkv" / "bench"))


@dataclass
class Cache:
    name: str
    kind: str  # "real" or "synthetic"
    layers: list[torch.Tensor]  # 2L tensors [H, T, D] bf16 (K0, V0, K1, V1, ...)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.layers)


@dataclass
class Row:
    cache: str
    tokens: int
    method: str
    encode_s: list[float] = field(default_factory=list)  # wall seconds per run
    decode_s: list[float] = field(default_factory=list)
    encode_cpu_s: list[float] = field(default_factory=list)  # process CPU seconds (all threads) per run
    decode_cpu_s: list[float] = field(default_factory=list)
    stored_bytes: int = 0
    note: str = ""


# ----------------------------------------------------------------------------------------------- caches
def synthetic_kv(layers: int, heads: int, tokens: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    """KV-like BF16 tensors: per-channel scale and offset, a few outlier channels, tokens correlated along T
    (keys drift smoothly with position), so that neither the quantizer nor zstd sees plain white noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2 * layers):
        scale = torch.rand(heads, 1, dim, generator=g) * 1.5 + 0.05
        scale[..., torch.randint(0, dim, (3,), generator=g)] *= 12.0
        offset = torch.randn(heads, 1, dim, generator=g) * 0.7
        noise = torch.randn(heads, tokens, dim, generator=g)
        drift = torch.cumsum(torch.randn(heads, tokens, dim, generator=g) * 0.05, dim=1)
        out.append(((noise + drift) * scale + offset).to(torch.bfloat16))
    return out


def real_smollm2_kv(tokens: int) -> list[torch.Tensor] | None:
    """Real SmolLM2-135M KV of the built-in prompt (first ``tokens`` tokens of an 8192-token prefill, which
    is the KV of that prefix: attention is causal), cached as safetensors; ``None`` if the model is missing."""
    from safetensors.torch import load_file, save_file

    path = CACHE_DIR / "smollm2_kv_8192.safetensors"
    if not path.exists():
        try:
            from lynxkv.hf import prefill
            from lynxkv.hf.models import encode_prompt, load_model
            from lynxkv.hf.prompts import builtin_prompt

            loaded = load_model()
        except Exception as exc:  # noqa: BLE001 - the offline model is optional for the benchmark
            print(f"real SmolLM2 KV unavailable ({exc}); using synthetic KV", file=sys.stderr)
            return None
        print("prefilling 8192 tokens of SmolLM2 once (cached in %s) ..." % path, file=sys.stderr)
        ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, tokens=8400))[:8192]
        kv, _ = prefill(loaded.model, ids)
        tensors = {}
        for i, (k, v) in enumerate(kv):
            tensors[f"k{i}"] = k.to(torch.bfloat16).contiguous()
            tensors[f"v{i}"] = v.to(torch.bfloat16).contiguous()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    data = load_file(str(path))
    n = len(data) // 2
    if data["k0"].shape[1] < tokens:
        return None
    return [data[f"{kind}{i}"][:, :tokens].contiguous() for i in range(n) for kind in ("k", "v")]


# ----------------------------------------------------------------------------------------------- methods
_CPU_LOG: list[float] = []


def timed(fn):
    """Wall time of ``fn()`` (returned) and its process CPU time (appended to ``_CPU_LOG``)."""
    c0, t0 = time.process_time(), time.perf_counter()
    res = fn()
    dt = time.perf_counter() - t0
    _CPU_LOG.append(time.process_time() - c0)
    return dt, res


def attach_cpu(row: "Row", pattern: str) -> None:
    """Distribute the CPU times logged by ``timed`` calls over the row's runs (``pattern``: "ed" = encode then
    decode per run, "e"/"d" single)."""
    logs = list(_CPU_LOG)
    _CPU_LOG.clear()
    for i, t in enumerate(logs):
        kind = pattern[i % len(pattern)]
        (row.encode_cpu_s if kind == "e" else row.decode_cpu_s).append(t)


def bench_copy(cache: Cache, row: Row, repeats: int) -> None:
    for _ in range(repeats):
        dt, _ = timed(lambda: [t.clone() for t in cache.layers])
        row.encode_s.append(dt)
        row.decode_s.append(dt)
    row.stored_bytes = cache.nbytes


def bench_safetensors(cache: Cache, row: Row, repeats: int, tmp: Path) -> None:
    from safetensors.torch import load, save_file

    tensors = {f"l{i}": t for i, t in enumerate(cache.layers)}
    path = tmp / "bench_cache.safetensors"
    for _ in range(repeats):
        dt, _ = timed(lambda: save_file(tensors, str(path)))
        row.encode_s.append(dt)
        dt, _ = timed(lambda: load(path.read_bytes()))  # read every byte (load_file maps lazily)
        row.decode_s.append(dt)
    row.stored_bytes = path.stat().st_size
    path.unlink()
    row.note = f"file in {tmp} (page cache, no fsync)"


def bench_zstd(cache: Cache, row: Row, repeats: int, level: int) -> bool:
    try:
        import zstandard
    except ImportError:
        row.note = "zstandard not installed"
        return False
    comp = zstandard.ZstdCompressor(level=level, threads=-1)
    decomp = zstandard.ZstdDecompressor()
    raw = [t.view(torch.uint8).numpy().tobytes() for t in cache.layers]
    for _ in range(repeats):
        dt, blobs = timed(lambda: [comp.compress(b) for b in raw])
        row.encode_s.append(dt)
        dt, _ = timed(lambda: [decomp.decompress(b) for b in blobs])
        row.decode_s.append(dt)
    row.stored_bytes = sum(len(b) for b in blobs)
    row.note = "lossless; compress on all cores"
    return True


def int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive symmetric absmax INT8 per token (over head_dim): ``q = round(x / s)``, ``s = max|x| / 127``."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(xf / s).clamp_(-127, 127).to(torch.int8), s.to(torch.float16)


def bench_int8(cache: Cache, row: Row, repeats: int) -> None:
    for _ in range(repeats):
        dt, enc = timed(lambda: [int8_per_token(t) for t in cache.layers])
        row.encode_s.append(dt)
        dt, _ = timed(lambda: [(q.float() * s.float()).to(torch.bfloat16) for q, s in enc])
        row.decode_s.append(dt)
    row.stored_bytes = sum(q.numel() + s.numel() * 2 for q, s in enc)
    row.note = "per-token absmax, lossy"


def bench_reference(cache: Cache, row: Row, repeats: int, scheme) -> None:
    def encode():
        out = []
        for t in cache.layers:
            e = quantize(t, scheme)
            out.append((pack_bits(e.anchor, 4), pack_bits(e.residual, 4), e.offset, e.scale, tuple(t.shape)))
        return out

    def decode(encs):
        for a, r, o, s, shape in encs:
            n = shape[0] * shape[1] * shape[2]
            e = EncodedTensor(unpack_bits(a, 4, n).view(shape), unpack_bits(r, 4, n).view(shape), o, s,
                              rotated=scheme.rotated("key"))  # every tensor is quantized as keys here
            dequantize(e, scheme, dtype=torch.bfloat16)

    for _ in range(repeats):
        dt, encs = timed(encode)
        row.encode_s.append(dt)
        dt, _ = timed(lambda: decode(encs))
        row.decode_s.append(dt)
    row.stored_bytes = sum(a.numel() + r.numel() + 2 * o.numel() * o.element_size() for a, r, o, _, _ in encs)
    row.note = "torch reference, bit-exact spec"


def bench_fast(cache: Cache, row: Row, anchor_row: Row, repeats: int, scheme) -> bool:
    outs = [torch.empty_like(t) for t in cache.layers]  # the preallocated BF16 cache decode writes into
    for _ in range(repeats):
        dt, encs = timed(lambda: [quantize_packed(t, scheme) for t in cache.layers])
        row.encode_s.append(dt)
        anchor_row.encode_s.append(dt)
        dt, _ = timed(lambda: [dequantize_packed(a, r, o, s, tuple(t.shape), scheme, out=out)
                               for (a, r, o, s), t, out in zip(encs, cache.layers, outs)])
        row.decode_s.append(dt)
        dt, _ = timed(lambda: [dequantize_packed(a, None, o, s, tuple(t.shape), scheme, out=out)
                               for (a, r, o, s), t, out in zip(encs, cache.layers, outs)])
        anchor_row.decode_s.append(dt)
    meta = sum(2 * o.numel() * o.element_size() for _, _, o, _ in encs)
    row.stored_bytes = sum(a.numel() + r.numel() for a, r, _, _ in encs) + meta
    anchor_row.stored_bytes = sum(a.numel() for a, _, _, _ in encs) + meta
    # spot check: one layer bit for bit against the reference (the tests check many shapes)
    probe = len(cache.layers) // 2
    ref = quantize(cache.layers[probe], scheme)
    a, r, o, s = encs[probe]
    exact = bool(torch.equal(a, pack_bits(ref.anchor, 4)) and torch.equal(r, pack_bits(ref.residual, 4))
                 and torch.equal(o, ref.offset) and torch.equal(s, ref.scale))
    row.note = "bit-exact vs reference: " + ("yes" if exact else "NO")
    anchor_row.note = "anchor segment + metadata only"
    return exact


# ----------------------------------------------------------------------------------------------- driver
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, one repeat, no reference at 8K (seconds)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--real", action="store_true", help="prefill SmolLM2 for real KV if no cached dump exists")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference rows")
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json", type=Path, default=Path("out/bench_codec.json"))
    ap.add_argument("--scheme", default="default", help="lynxkv scheme preset (default, linear, ...)")
    args = ap.parse_args(argv)
    scheme = get_scheme(args.scheme)

    if args.quick:
        repeats, plan = 1, [
            ("smollm2-shape", "synthetic", 4, 3, 64, 256),
            ("llama3-8b-shape", "synthetic", 2, 8, 128, 256),
        ]
    else:
        repeats, plan = args.repeats, []
        for tokens in args.tokens:
            plan.append(("smollm2", "real", 30, 3, 64, tokens))
            plan.append(("llama3-8b-shape", "synthetic", 32, 8, 128, tokens))

    rows: list[Row] = []
    all_exact = True
    for name, kind, layers, heads, dim, tokens in plan:
        kv = None
        if kind == "real" and (args.real or (CACHE_DIR / "smollm2_kv_8192.safetensors").exists()):
            kv = real_smollm2_kv(tokens)
        if kv is None:
            kind = "synthetic"
            kv = synthetic_kv(layers, heads, tokens, dim)
        cache = Cache(name, kind, kv)
        label = f"{name} ({kind})"
        BF16_BYTES[(label, tokens)] = cache.nbytes
        print(f"{label}: {len(kv) // 2} layers x K,V [{heads}, {tokens}, {dim}] bf16 = {cache.nbytes / 1e6:.1f} MB",
              file=sys.stderr)
        runs = repeats + 1
        mk = lambda method: Row(label, tokens, method)  # noqa: E731
        r_copy, r_st, r_i8, r_fast, r_anchor = mk("copy"), mk("safetensors"), mk("int8/token"), mk("lynxkv-fast"), mk("lynxkv-anchor")
        bench_copy(cache, r_copy, runs)
        attach_cpu(r_copy, "e")
        r_copy.decode_cpu_s = list(r_copy.encode_cpu_s)
        bench_safetensors(cache, r_st, runs, args.tmp)
        attach_cpu(r_st, "ed")
        zrows = []
        for level in (1, 3):
            rz = mk(f"zstd-{level}")
            bench_zstd(cache, rz, runs, level)
            attach_cpu(rz, "ed")
            zrows.append(rz)
        bench_int8(cache, r_i8, runs)
        attach_cpu(r_i8, "ed")
        all_exact &= bench_fast(cache, r_fast, r_anchor, runs, scheme)
        logs = list(_CPU_LOG)  # per run: encode, full decode, anchor decode
        _CPU_LOG.clear()
        r_fast.encode_cpu_s, r_fast.decode_cpu_s = logs[0::3], logs[1::3]
        r_anchor.encode_cpu_s, r_anchor.decode_cpu_s = logs[0::3], logs[2::3]
        rows += [r_copy, r_st, *zrows, r_i8]
        if args.no_reference or cache.numel > 200_000_000:
            print(f"{label}: torch reference skipped (too slow at this size; see the smaller caches)", file=sys.stderr)
        else:
            r_ref = mk("lynxkv-ref")
            bench_reference(cache, r_ref, 2 if cache.numel > 20_000_000 else runs, scheme)
            attach_cpu(r_ref, "ed")
            rows.append(r_ref)
        rows += [r_fast, r_anchor]
        for r in rows:  # the first run of each method is a warm-up (allocator, page faults, thread pools)
            if r.cache == label and len(r.encode_s) > 1:
                r.encode_s, r.decode_s = r.encode_s[1:], r.decode_s[1:]
                r.encode_cpu_s, r.decode_cpu_s = r.encode_cpu_s[1:], r.decode_cpu_s[1:]

    print_table(rows, {r.cache: r for r in rows if r.method == "copy"})
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "load_avg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "scheme": scheme.describe(),
        "command": " ".join(sys.argv),
        "rows": [dict(cache=r.cache, tokens=r.tokens, method=r.method, encode_s=r.encode_s, decode_s=r.decode_s,
                      encode_cpu_s=r.encode_cpu_s, decode_cpu_s=r.decode_cpu_s,
                      encode_GBps=gbps(r, "encode"), decode_GBps=gbps(r, "decode"),
                      encode_GB_per_cpu_s=gbps(r, "encode", cpu=True), decode_GB_per_cpu_s=gbps(r, "decode", cpu=True),
                      stored_bytes=r.stored_bytes,
                      bf16_bytes=BF16_BYTES[(r.cache, r.tokens)], note=r.note) for r in rows],
        "fast_bit_exact": all_exact,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all_exact else 1


BF16_BYTES: dict[tuple[str, int], int] = {}


def gbps(row: Row, which: str, cpu: bool = False) -> float | None:
    if cpu:
        times = row.encode_cpu_s if which == "encode" else row.decode_cpu_s
    else:
        times = row.encode_s if which == "encode" else row.decode_s
    if not times:
        return None
    return BF16_BYTES[(row.cache, row.tokens)] / median(times) / 1e9


def print_table(rows: list[Row], copies: dict[str, Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KV codec throughput (GB/s of BF16 KV, medians) and size")
    cols = ("cache", "tokens", "method", "encode GB/s", "decode GB/s", "enc GB/cpu-s", "dec GB/cpu-s", "stored MB",
            "bits/elem", "note")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("cache", "method", "note") else "left")
    fmt = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
    for r in rows:
        numel = BF16_BYTES[(r.cache, r.tokens)] / 2
        table.add_row(r.cache, str(r.tokens), r.method, fmt(gbps(r, "encode")), fmt(gbps(r, "decode")),
                      fmt(gbps(r, "encode", cpu=True)), fmt(gbps(r, "decode", cpu=True)),
                      f"{r.stored_bytes / 1e6:.1f}", f"{8 * r.stored_bytes / numel:.2f}", r.note)
    Console(width=180).print(table)


if __name__ == "__main__":
    sys.exit(main())
