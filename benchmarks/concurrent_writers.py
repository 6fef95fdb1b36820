"""Two processes replace the same two-file cache with different contents while readers open it.

    python benchmarks/concurrent_writers.py --writes 200 --readers 2 [--via save|stream] [--json out.json]

Writers A and B each write one path ``--writes`` times, A cache A and B cache B: with :func:`lynxkv.save_cache`
(``--via save``, the writer of ``lynxkv encode``), or with ``lynxkv stream REF -o PATH --force`` (``--via stream``,
each a copy of a saved reference cache, run through ``lynxkv.cli.main`` in the writer's process). Readers loop: read the anchor's cache id, load the whole cache (:meth:`LynxCache.load_kv`, every CRC and
the residual's cache id checked), read the anchor's cache id again. A load that succeeds must equal cache A's or
cache B's decoded KV exactly (else: *wrong data*). A load that fails while the same anchor stayed in place
throughout (the same cache id before and after; ids are fresh per write) is a cache *broken in place*: its anchor
named a residual that was missing or another write's; a failure across a replacement is a benign race (the
reader opened the old anchor and its residual went with it) and is counted apart. At the end the path must hold
one whole cache, A's or B's, and no file beside it that no cache names.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from lynxkv.cache import open_cache, residual_file_of, save_cache, verify_file
from lynxkv.errors import LynxError
from lynxkv.quant.scheme import Scheme

SCHEME = Scheme(chunk=8, page=16)


def kv(seed: int, layers=4, heads=2, tokens=128, dim=32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, tokens, dim, generator=g), torch.randn(heads, tokens, dim, generator=g))
            for _ in range(layers)]


def anchor_id(path: str) -> str | None:
    from lynxkv.format.reader import read_anchor_header
    from lynxkv.storage import BytesSource

    try:
        with open(path, "rb") as f:
            return read_anchor_header(BytesSource(f.read(), "anchor")).cache_id.hex()
    except (OSError, LynxError):
        return None


def same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def writer(path: str, which: str, writes: int, via: str, ref: str) -> None:
    if via == "stream":
        from lynxkv.cli import main

        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        for _ in range(writes):
            if main(["stream", ref, "-o", path, "--force"]) != 0:
                raise SystemExit(1)
        return
    data = kv(ord(which))
    for _ in range(writes):
        save_cache(path, data, SCHEME, properties={"writer": which})


def reader(path: str, want: dict, flag: str, out: str) -> None:
    tally = {"A": 0, "B": 0, "wrong_data": 0, "broken_in_place": 0, "raced_a_replacement": 0, "absent": 0}
    errors, seconds = [], []
    while not os.path.exists(flag):
        before = anchor_id(path)
        if before is None:
            tally["absent"] += 1
            continue
        t = time.perf_counter()
        try:
            with open_cache(path) as cache:
                got = cache.load_kv()
            seconds.append(time.perf_counter() - t)
            which = next((w for w, ref in want.items() if same(got, ref)), None)
            tally[which or "wrong_data"] += 1
        except LynxError as exc:
            if anchor_id(path) == before:
                tally["broken_in_place"] += 1
                errors.append(str(exc))
            else:
                tally["raced_a_replacement"] += 1
    tally["errors"] = errors[:5]
    tally["load_median_ms"] = round(statistics.median(seconds) * 1e3, 2) if seconds else None
    with open(out, "w") as f:
        json.dump(tally, f)


def fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        finally:
            os._exit(code)
    return pid


def run(writes: int, readers: int, work: str, via: str = "save") -> dict:
    want = {}
    for w in "AB":  # the decoded KV each writer's cache must give, exactly
        ref = os.path.join(work, f"ref{w}.lynx")
        save_cache(ref, kv(ord(w)), SCHEME, properties={"writer": w})
        with open_cache(ref) as cache:
            want[w] = cache.load_kv()
    os.makedirs(os.path.join(work, "c"))
    path, flag = os.path.join(work, "c", "c.lynx"), os.path.join(work, "stop")
    save_cache(path, kv(ord("A")), SCHEME, properties={"writer": "A"})
    t0 = time.perf_counter()
    writers = [fork(writer, path, w, writes, via, os.path.join(work, f"ref{w}.lynx")) for w in "AB"]
    pids = [fork(reader, path, want, flag, os.path.join(work, f"r{i}.json")) for i in range(readers)]
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in writers]
    wall = time.perf_counter() - t0
    open(flag, "w").close()
    for p in pids:
        os.waitpid(p, 0)
    out = {"via": via, "writes_per_writer": writes, "writer_exit_codes": codes, "writers_wall_s": round(wall, 2),
           "readers": readers}
    tallies = [json.load(open(os.path.join(work, f"r{i}.json"))) for i in range(readers)]
    for k in ("A", "B", "wrong_data", "broken_in_place", "raced_a_replacement", "absent"):
        out[k] = sum(t[k] for t in tallies)
    out["errors"] = [e for t in tallies for e in t["errors"]][:5]
    out["reader_load_median_ms"] = [t["load_median_ms"] for t in tallies]
    out["final"] = final_state(path)
    return out


def final_state(path: str) -> dict:
    d = os.path.dirname(path)
    findings = verify_file(path) if os.path.exists(path) else ["absent"]
    which = None
    if not findings:
        with open_cache(path) as cache:
            which = cache.info.properties.get("writer")
    r = residual_file_of(path)
    extra = sorted(set(os.listdir(d)) - {os.path.basename(path), os.path.basename(r or "")})
    return {"whole": not findings, "writer": which, "findings": [str(f) for f in findings[:3]], "leftovers": extra}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writes", type=int, default=200, help="writes per writer")
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--via", choices=("save", "stream"), default="save", help="save_cache, or lynxkv stream -o")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="lynx-concurrent-")
    try:
        out = run(args.writes, args.readers, work, args.via)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.writes} writes ({args.via}) by each of 2 writers in {out['writers_wall_s']} s (exit codes {out['writer_exit_codes']}); "
          f"{args.readers} readers loaded cache A {out['A']} times, cache B {out['B']} times (median load "
          f"{out['reader_load_median_ms']} ms)")
    print(f"wrong data {out['wrong_data']}, broken in place {out['broken_in_place']}, failed across a replacement "
          f"{out['raced_a_replacement']}, no anchor {out['absent']}")
    f = out["final"]
    print(f"final: whole {f['whole']} (writer {f['writer']}), leftovers {f['leftovers']} {f['findings']}")
    for e in out["errors"]:
        print("ERROR", e)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    bad = out["wrong_data"] or out["broken_in_place"] or not f["whole"] or f["leftovers"] or any(out["writer_exit_codes"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
