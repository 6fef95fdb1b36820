"""The user path, side by side with zstd-1: what ``lynxkv encode`` / ``decode`` / ``run`` / ``stream`` execute.

Through the public API only, in one process, the default scheme, each step repeated (interleaved) and the
median taken:

- ``save_cache``: quantize + pack + write the anchor and residual files, fsync included (``lynxkv.save_cache``;
  the files are deleted after the timed step, as safetensors' are);
- ``load_kv``: ``lynxkv.open_cache(path).load_kv()`` (every page read, CRC checked, decoded to BF16);
- ``load_kv anchor``: ``load_kv(anchor_only=True)``;
- ``progressive anchor``: ``lynxkv.stream.open_progressive(path)`` until ``wait_anchor()`` returns (no link
  limit), then closed;
- against ``zstd-1`` compress / decompress of the raw BF16 bytes (python-zstandard, one thread, its
  defaults), ``zstd-1`` decompress of the anchor file's bytes, and ``safetensors`` save as a reference point.

Ratios and their targets: save_cache / zstd-1 compress >= 1.0, full load / zstd-1 decompress >= 2.0,
anchor-only load / zstd-1 decompress >= 3.0, progressive to anchor-ready / zstd-1 decompress of the anchor's
bytes >= 2.0; each is time(zstd) / time(lynxkv), so above 1 means lynxkv is faster. Throughputs are GB/s of
BF16 KV (bytes of the BF16 cache / wall seconds). Each step's process CPU time (all threads) is printed beside
its wall time, with the same ratios in CPU time: on a loaded machine the wall ratios move with the load, the CPU
costs much less. Files go to ``--tmp`` (page cache; no fsync is timed beyond what ``save_cache`` itself does).

Caches: (a) a synthetic Llama-3-8B-shaped BF16 cache, 16 layers x 8 KV heads x 4,096 tokens x 128 (268 MB),
with KV-like statistics; (b) real SmolLM2-135M KV of ~4K tokens of CPython's ``pydoc_data/topics.py`` (the
built-in prompt text), prefilled once and cast to BF16 (``--no-model`` skips it).

    python benchmarks/bench_user_path.py                       # both caches, 5 repeats
    python benchmarks/bench_user_path.py --no-model --repeats 3 --json out/user_path.json
    python benchmarks/bench_user_path.py --profile             # also cProfile one round of each step
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zstandard
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codec import synthetic_kv  # noqa: E402 - the benchmarks share one synthetic KV generator

import lynxkv  # noqa: E402
from lynxkv.stream import open_progressive  # noqa: E402

TARGETS = {"save/zstd-c": 1.0, "load/zstd-d": 2.0, "anchor/zstd-d": 3.0, "progressive/zstd-d(anchor)": 2.0}


def llama_shaped() -> list[tuple[torch.Tensor, torch.Tensor]]:
    flat = synthetic_kv(16, 8, 4096, 128)
    return list(zip(flat[0::2], flat[1::2]))


def smollm2_kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    try:
        from lynxkv.hf.models import encode_prompt, load_model
        from lynxkv.hf.prefill import prefill
        from lynxkv.hf.prompts import builtin_prompt

        lm = load_model()
    except Exception as exc:  # noqa: BLE001 - the offline model is optional here
        print(f"SmolLM2 unavailable ({exc}); skipping the real cache", file=sys.stderr)
        return None
    print(f"prefilling {tokens} tokens of SmolLM2 ...", file=sys.stderr)
    ids = encode_prompt(lm, builtin_prompt(lm.tokenizer, tokens=tokens))
    kv, _ = prefill(lm.model, ids)
    return [(k.to(torch.bfloat16).contiguous(), v.to(torch.bfloat16).contiguous()) for k, v in kv]


def raw_bytes(kv) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for pair in kv for t in pair)


class Steps:
    """The timed steps of one cache; every call writes into a fresh name under ``tmp``."""

    def __init__(self, kv, tmp: Path):
        self.kv, self.tmp, self.n = kv, tmp, 0
        self.written: list[Path] = []
        self.raw = raw_bytes(kv)
        self.zc = zstandard.ZstdCompressor(level=1)
        self.zd = zstandard.ZstdDecompressor()
        self.z = self.zc.compress(self.raw)
        self.path = tmp / "bench.lynx"
        lynxkv.save_cache(self.path, kv, lynxkv.DEFAULT)
        self.anchor_z = self.zc.compress(self.path.read_bytes())
        self.anchor_bytes = self.path.stat().st_size

    def save_cache(self):
        self.n += 1
        p = self.tmp / f"s{self.n}.lynx"
        lynxkv.save_cache(p, self.kv, lynxkv.DEFAULT)
        self.written += [p, p.with_suffix(".lynxr")]

    def clean(self):
        """Remove what the last step wrote (not timed: deleting a file is no part of writing it)."""
        for p in self.written:
            p.unlink()
        self.written = []

    def load_kv(self):
        with lynxkv.open_cache(self.path) as cache:
            cache.load_kv()

    def load_anchor(self):
        with lynxkv.open_cache(self.path) as cache:
            cache.load_kv(anchor_only=True)

    def progressive_anchor(self):
        load = open_progressive(str(self.path), dtype=torch.bfloat16)
        try:
            load.wait_anchor()
        finally:
            load.close()

    def zstd_compress(self):
        self.zc.compress(self.raw)

    def zstd_decompress(self):
        self.zd.decompress(self.z)

    def zstd_decompress_anchor(self):
        self.zd.decompress(self.anchor_z)

    def safetensors_save(self):
        self.n += 1
        p = self.tmp / f"s{self.n}.safetensors"
        save_file({f"{i}.{j}": t for i, pair in enumerate(self.kv) for j, t in enumerate(pair)}, str(p))
        self.written.append(p)


STEPS = ("save_cache", "load_kv", "load_anchor", "progressive_anchor", "zstd_compress", "zstd_decompress",
         "zstd_decompress_anchor", "safetensors_save")


def measure(name: str, kv, repeats: int, tmp: Path, profile: bool) -> dict:
    steps = Steps(kv, tmp)
    nbytes = len(steps.raw)
    load_before = os.getloadavg()
    for step in STEPS:  # warm-up: compile caches, page cache, thread pools
        getattr(steps, step)()
        steps.clean()
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    cpu: dict[str, list[float]] = {s: [] for s in STEPS}
    for _ in range(repeats):
        for step in STEPS:
            t0, c0 = time.perf_counter(), time.process_time()
            getattr(steps, step)()
            times[step].append(time.perf_counter() - t0)
            cpu[step].append(time.process_time() - c0)
            steps.clean()
    med = {s: statistics.median(v) for s, v in times.items()}
    cpu_med = {s: statistics.median(v) for s, v in cpu.items()}

    def ratios_of(m: dict[str, float]) -> dict[str, float]:
        return {
            "save/zstd-c": m["zstd_compress"] / m["save_cache"],
            "load/zstd-d": m["zstd_decompress"] / m["load_kv"],
            "anchor/zstd-d": m["zstd_decompress"] / m["load_anchor"],
            "progressive/zstd-d(anchor)": m["zstd_decompress_anchor"] / m["progressive_anchor"],
        }

    ratios = ratios_of(med)
    profiles = {}
    if profile:
        for step in ("save_cache", "load_kv", "load_anchor", "progressive_anchor"):
            prof = cProfile.Profile()
            prof.runcall(getattr(steps, step))
            steps.clean()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            profiles[step] = out.getvalue()
    shape = tuple(kv[0][0].shape)
    return {
        "cache": name, "layers": len(kv), "shape": shape, "bf16_bytes": nbytes, "anchor_file_bytes": steps.anchor_bytes,
        "seconds": times, "median_s": med, "gbps": {s: nbytes / t / 1e9 for s, t in med.items()}, "ratios": ratios,
        "cpu_seconds": cpu, "median_cpu_s": cpu_med, "cpu_ratios": ratios_of(cpu_med),
        "profiles": profiles, "loadavg": {"start": load_before, "end": os.getloadavg()},
    }


def print_result(r: dict) -> None:
    print(f"\n{r['cache']}: {r['layers']} layers x K,V {list(r['shape'])} bf16 = {r['bf16_bytes'] / 1e6:.0f} MB "
          f"(anchor file {r['anchor_file_bytes'] / 1e6:.0f} MB); load average (1/5/15 min) "
          + " -> ".join("/".join(f"{x:.1f}" for x in r["loadavg"][k]) for k in ("start", "end")))
    print(f"  {'step':<24} {'median s':>9} {'GB/s of BF16 KV':>16} {'median CPU s':>13}")
    for s in STEPS:
        print(f"  {s:<24} {r['median_s'][s]:>9.3f} {r['gbps'][s]:>16.2f} {r['median_cpu_s'][s]:>13.3f}")
    print(f"  {'ratio (zstd time / lynxkv time)':<40} {'value':>6} {'target':>7} {'':>8} {'CPU-time ratio':>14}")
    for k, v in r["ratios"].items():
        print(f"  {k:<40} {v:>6.2f} {'>= ' + str(TARGETS[k]):>7} {'met' if v >= TARGETS[k] else 'NOT met':>8} "
              f"{r['cpu_ratios'][k]:>14.2f}")
    print("  (CPU time: the process's, every thread summed: a load-independent cost; lynxkv's steps run on "
          f"{torch.get_num_threads()} threads, zstd on one)")
    for step, text in r["profiles"].items():
        print(f"\n  cProfile, one {step}:\n" + "\n".join("    " + line for line in text.splitlines()[:30]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the real SmolLM2 prompt")
    ap.add_argument("--no-model", action="store_true", help="skip the real SmolLM2 cache")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the Llama-3-8B-shaped cache")
    ap.add_argument("--profile", action="store_true", help="cProfile one round of each lynxkv step")
    ap.add_argument("--json", type=Path, help="write every sample and the medians here")
    ap.add_argument("--tmp", type=Path, default=None, help="directory for the files (default: a temp dir)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="lynxkv-bench-", dir=args.tmp))
    results = []
    try:
        cases = []
        if not args.no_synthetic:
            cases.append(("llama3-8b-shape (synthetic)", llama_shaped))
        if not args.no_model:
            cases.append((f"smollm2 real KV (~{args.tokens} tokens of pydoc topics)", lambda: smollm2_kv(args.tokens)))
        for name, make in cases:
            kv = make()
            if kv is None:
                continue
            r = measure(name, kv, args.repeats, tmp, args.profile)
            print_result(r)
            results.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info = {"results": results, "repeats": args.repeats, "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(info, indent=1, default=list))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
