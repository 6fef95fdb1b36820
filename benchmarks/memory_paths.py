"""Peak memory of every read path against the cache's decoded size: how far RSS rises above a process that has
imported lynxkv and torch while it decodes, loads, verifies, streams or serves one cache.

The cache is synthetic, Llama-3-8B-shaped BF16 KV (default 16 layers x 8 KV heads x 4,096 tokens x 128: 268 MB
decoded), written with ``save_cache``. Every path runs in a fresh interpreter that imports torch, lynxkv and the
modules the path uses, takes its RSS (the baseline), resets the kernel's high-water mark (``/proc/self/
clear_refs``), runs the path and reads the mark back (``VmHWM``; a 2 ms polling thread of ``VmRSS`` beside it, and
the larger of the two is taken). ``serve`` is measured in the server's process while this process reads both
resources over HTTP as whole-segment range requests, twice, and the server exits (``--once``).

    python benchmarks/memory_paths.py [--layers 16 --heads 8 --tokens 4096 --dim 128] [--repeats 3]
                                      [--paths decode,load_kv,...] [--json out/memory_paths.json]

Peaks are medians over ``--repeats`` fresh processes. Linux only (``/proc``). The children run ``python -c``, which
puts the working directory first on ``sys.path``: to measure another checkout through ``PYTHONPATH``, run the
script from a directory that holds no ``lynxkv``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

TARGET = 1.5

# What runs in each fresh process: the measured call, and the modules imported before the baseline.
PATHS = {
    "decode": "CLI `lynxkv decode -o x.safetensors`",
    "decode-anchor": "CLI `lynxkv decode --anchor-only -o`",
    "load_kv": "API `open_cache(p).load_kv()`",
    "verify": "CLI `lynxkv verify`",
    "stream": "CLI `lynxkv stream` (local file)",
    "stream-o": "CLI `lynxkv stream -o copy.lynx`",
    "progressive": "API `open_progressive(p, dtype=bf16)`, anchor + full",
    "serve": "CLI `lynxkv serve --once`, whole-segment ranges",
}

CHILD = r'''
import json, os, sys, threading, time
import torch, lynxkv, lynxkv.cli, lynxkv.cache, lynxkv.stream.progressive, lynxkv.serve, safetensors.torch
from lynxkv.cli import main

def status():
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) * 1024
    return d

path, cache, work = sys.argv[1], sys.argv[2], sys.argv[3]
held = []
base = status()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark restarts from the RSS now
peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
stop = threading.Event()

def poll():
    while not stop.is_set():
        s = status()
        for k in peak:
            peak[k] = max(peak[k], s[k])
        time.sleep(0.002)

poller = threading.Thread(target=poll, daemon=True)
poller.start()
t0 = time.perf_counter()
code = 0
if path == "decode":
    code = main(["decode", cache, "-o", os.path.join(work, "out.safetensors"), "--force"])
elif path == "decode-anchor":
    code = main(["decode", cache, "--anchor-only", "-o", os.path.join(work, "out.safetensors"), "--force"])
elif path == "load_kv":
    with lynxkv.cache.open_cache(cache) as c:
        held.append(c.load_kv())
elif path == "verify":
    code = main(["verify", cache])
elif path == "stream":
    code = main(["stream", cache, "--json"])
elif path == "stream-o":
    code = main(["stream", cache, "-o", os.path.join(work, "copy", "copy.lynx"), "--force", "--json"])
elif path == "progressive":
    load = lynxkv.stream.progressive.open_progressive(cache, dtype=torch.bfloat16)
    held.append((load.wait_anchor(), load.residual.result()))
    load.close()
elif path == "serve":
    code = main(["serve", cache, "--port", "0", "--once", "--json"])
seconds = time.perf_counter() - t0
stop.set()
poller.join()
end = status()
print("MEMORY " + json.dumps({"code": code, "seconds": seconds, "base": base["VmRSS"],
                              "peak": max(end["VmHWM"], peak["VmRSS"]), "peak_anon": peak["RssAnon"],
                              "peak_file": peak["RssFile"], "base_anon": base["RssAnon"],
                              "base_file": base["RssFile"]}), flush=True)
'''


def build(path: str, layers: int, heads: int, tokens: int, dim: int) -> None:
    """Write the cache (in a child: this process stays small, and no measured process inherits its pages)."""
    import torch

    from lynxkv.cache import save_cache

    g = torch.Generator().manual_seed(0)
    kv = []
    for _ in range(layers):  # KV-like: keys with a few large channels, values plain Gaussian
        k = torch.randn(heads, tokens, dim, generator=g) * (1 + 4 * (torch.rand(1, 1, dim, generator=g) > 0.9))
        v = torch.randn(heads, tokens, dim, generator=g)
        kv.append((k.to(torch.bfloat16), v.to(torch.bfloat16)))
    save_cache(path, kv)


def _serve_client(proc: subprocess.Popen) -> None:
    """Read the served cache's anchor and residual as whole-segment range requests, twice, discarding the bytes."""
    text = ""
    while True:  # `serve --json` prints its address as one indented JSON document
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"serve: exited before it printed its address\n{proc.stderr.read()[-2000:]}")
        text += line
        if line.startswith("}"):
            break
    described = json.loads(text)
    base = described["url"].rsplit("/", 1)[0]
    for _ in range(2):
        for res in ("anchor", "residual"):
            if described.get(res) is None:
                continue
            req = urllib.request.Request(f"{base}/{described[res]['path']}",
                                         headers={"Range": f"bytes=0-{described[res]['size'] - 1}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                while r.read(1 << 20):
                    pass


def measure(path: str, cache: str, work: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, path, cache, work]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if path == "serve":
        _serve_client(proc)
    out, errs = proc.communicate(timeout=600)
    lines = [ln for ln in out.splitlines() if ln.startswith("MEMORY ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{path}: exit {proc.returncode}\n{errs[-2000:]}")
    return json.loads(lines[-1][len("MEMORY "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in (("layers", 16), ("heads", 8), ("tokens", 4096), ("dim", 128)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per path (median)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS))
    ap.add_argument("--json", default=None, help="write every sample here")
    ap.add_argument("--build", help=argparse.SUPPRESS)  # internal: write the cache to this path
    a = ap.parse_args()
    if a.build:
        build(a.build, a.layers, a.heads, a.tokens, a.dim)
        return
    paths = [p for p in a.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        ap.error(f"unknown path(s) {sorted(unknown)}; expected some of {', '.join(PATHS)}")
    decoded = 2 * a.layers * a.heads * a.tokens * a.dim * 2  # K and V, BF16
    with tempfile.TemporaryDirectory(prefix="lynxkv-mem-") as work:
        cache = os.path.join(work, "llama.lynx")
        os.mkdir(os.path.join(work, "copy"))  # `stream -o` writes its copy here, residual beside it
        subprocess.run([sys.executable, __file__, "--build", cache, "--layers", str(a.layers), "--heads",
                        str(a.heads), "--tokens", str(a.tokens), "--dim", str(a.dim)], check=True)
        stored = os.path.getsize(cache) + os.path.getsize(cache + "r")
        load = os.getloadavg()[0]
        print(f"cache: {a.layers} layers x {a.heads} KV heads x {a.tokens} tokens x {a.dim} head dim, bf16: "
              f"decoded {decoded / 1e6:.1f} MB, stored {stored / 1e6:.1f} MB (anchor + residual); "
              f"{a.repeats} fresh process(es) per path, medians; load average {load:.2f}")
        rows, samples = [], {}
        for path in paths:
            runs = [measure(path, cache, work) for _ in range(a.repeats)]
            samples[path] = runs
            above = statistics.median(r["peak"] - r["base"] for r in runs)
            anon = statistics.median(r["peak_anon"] - r["base_anon"] for r in runs)
            rows.append((path, statistics.median(r["base"] for r in runs), above, anon,
                         statistics.median(r["seconds"] for r in runs)))
        print(f"\n| path | what runs | imported process | peak above it | (anonymous) | decoded size | ratio | "
              f"target <= {TARGET} | s |")
        print("|---|---|---:|---:|---:|---:|---:|---|---:|")
        for path, base, above, anon, secs in rows:
            ratio = above / decoded
            print(f"| {path} | {PATHS[path]} | {base / 1e6:.0f} MB | {above / 1e6:.0f} MB | {anon / 1e6:.0f} MB "
                  f"| {decoded / 1e6:.0f} MB | {ratio:.2f} | {'yes' if ratio <= TARGET else 'NO'} | {secs:.2f} |")
        if "progressive" in paths:
            print("\n`progressive` hands back two caches, the anchor-only KV and the full KV: 2.0x is its floor.")
        print(f"\nload average {os.getloadavg()[0]:.2f} at the end, {time.strftime('%Y-%m-%d %H:%M')}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"shape": [a.layers, a.heads, a.tokens, a.dim], "decoded_bytes": decoded,
                       "stored_bytes": stored, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
