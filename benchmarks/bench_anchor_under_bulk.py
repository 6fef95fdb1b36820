"""When the anchor arrives across a real shaped link with the residual and a competing bulk TCP flow on it.

    sudo .venv/bin/python benchmarks/bench_anchor_under_bulk.py --rates 60Mbps,200Mbps,1Gbps --repeats 5

One cache (``lynxkv encode --model smollm2 --tokens 3000``: an anchor of about 21.6 MB, or ``--cache PATH``) is
served by ``lynxkv serve`` in the server namespace of a :class:`lynxkv.bench.netlab.NetLab` twice: with the DSCP
marks (``--dscp-anchor EF --dscp-residual CS1``) and without them. The client namespace runs one reader process
that loads it as ``lynxkv stream URL`` does (``open_progressive(URL, decode=False)``: every page moved and
CRC-checked, anchor and residual requested together, so the residual flows while the anchor does) and reports
what ``lynxkv stream --json`` prints (:func:`lynxkv.stream.summary.transfer_report`): ``anchor_ready_s``, the
last anchor page in and checked, and ``residual_ready_s``, both from the load's start. The process made one load
before the first timed one, as a decoder that has made an HTTP request before (a fresh process first pays its
HTTP stack's start-up).

Three conditions, their order rotated each round, at each ``--rates`` rate:

- ``alone``: marked, nothing else on the link but the residual;
- ``bulk``: marked, an unmarked bulk TCP stream (:mod:`lynxkv.bench.bulk`, server to client) started a second
  before the load and stopped after it;
- ``bulk, unmarked``: the same bulk stream, the server without marks: what the classes buy.

Per condition, medians with min-max over the rounds: the anchor's ready time over ``anchor bytes / rate`` (the
payload alone: TCP/IP and Ethernet headers, which the shaper counts, put the floor at about 1.046 on a 1500-byte
MTU), its ratio to ``alone`` in the same round, the residual's ready time, the residual bytes in when the anchor
was ready, and the bulk stream's rate while the load ran (from the shaper's class counters; unmarked, the load's
own bytes, as the marked runs counted them, are taken out of the default class). Nothing tells lynxkv the rate.
``--json PATH`` writes every run.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lab_held_out import ENV, Remote, fmt, lynx_serve, markdown_table, spread, worker  # noqa: E402 - the lab's helpers

CONDITIONS = ("alone", "bulk", "bulk, unmarked")
BULK_LEAD_S = 1.0  # the bulk stream runs this long before the load opens: its window open, the link full
BULK_MAX_S = 120.0  # bounds a bulk stream the driver failed to stop


class Reader:
    """The client's side: one load at a time, as ``lynxkv stream URL --json``."""

    def __init__(self, _scratch: Path):
        pass

    def load(self, url: str) -> dict:
        from lynxkv.stream.progressive import open_progressive
        from lynxkv.stream.summary import transfer_report

        at_anchor: dict = {}
        box: list = []

        def on_event(ev) -> None:
            if ev.kind == "anchor_ready" and box:
                at_anchor["residual_bytes"] = box[0].timeline.residual_bytes

        load = open_progressive(url, decode=False, on_event=on_event)
        box.append(load)
        try:
            load.residual.result(600)
            report = transfer_report(load, source=url)
        finally:
            load.close()
        return {"anchor_ready_s": report["anchor_ready_s"], "residual_ready_s": report["residual_ready_s"],
                "anchor_first_s": load.timeline.extra.get("anchor_first_s"), "anchor_bytes": report["anchor_bytes"],
                "residual_bytes": report["residual_bytes"], "residual_at_anchor": at_anchor.get("residual_bytes")}


def encode(d: Path, tokens: int, log) -> Path:
    cache = d / "c.lynx"
    subprocess.run([sys.executable, "-m", "lynxkv", "encode", "--model", "smollm2", "--tokens", str(tokens), "-o",
                    str(cache)], check=True, stdout=log, stderr=log, env=ENV)
    return cache


def one_run(lab, remote: Remote, url: str, bulk: bool) -> dict:
    stream = lab.start_bulk(seconds=BULK_MAX_S) if bulk else None
    try:
        if stream is not None:
            time.sleep(BULK_LEAD_S)
        before, t0 = lab.class_bytes("server"), time.perf_counter()
        run = remote.call("load", url)
        elapsed, after = time.perf_counter() - t0, lab.class_bytes("server")
    finally:
        competing = stream.stop() if stream is not None else None
    run["classes"] = {k: after[k] - before[k] for k in after}
    run["window_s"] = elapsed
    if competing is not None and competing["received"] <= 0:
        raise SystemExit("the bulk stream carried nothing: no competition was measured")
    return run


def row_of(rate: str, bits: float, cond: str, runs: list[dict], alone: list[dict], marked_wire: float) -> dict:
    ideal = runs[0]["anchor_bytes"] * 8 / bits
    bulk_mbit = []
    for r in runs:
        c = r["classes"]
        if cond == "bulk":
            bulk_mbit.append(c["bulk"] * 8 / r["window_s"] / 1e6)
        elif cond == "bulk, unmarked":
            bulk_mbit.append((c["bulk"] - marked_wire) * 8 / r["window_s"] / 1e6)
    return {"rate": rate, "condition": cond, "ideal_s": ideal, "runs": runs,
            "anchor_s": spread(r["anchor_ready_s"] for r in runs),
            "ratio": spread(r["anchor_ready_s"] / ideal for r in runs),
            "vs_alone": spread(r["anchor_ready_s"] / a["anchor_ready_s"] for r, a in zip(runs, alone)),
            "first_ms": spread(r["anchor_first_s"] * 1e3 for r in runs),
            "residual_s": spread(r["residual_ready_s"] for r in runs),
            "residual_at_anchor_mb": spread(r["residual_at_anchor"] / 1e6 for r in runs
                                            if r["residual_at_anchor"] is not None),
            "bulk_mbit": spread(bulk_mbit)}


def measure(lab, remote: Remote, urls: dict[str, str], a) -> list[dict]:
    from lynxkv.bench.shaping import parse_rate

    rows = []
    remote.call("load", urls["alone"])  # the reader's HTTP stack started, as in a process that has fetched before
    for rate in a.rates.split(","):
        lab.set_rate(rate)
        runs: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
        for r in range(a.repeats):
            for cond in CONDITIONS[r % len(CONDITIONS):] + CONDITIONS[:r % len(CONDITIONS)]:
                runs[cond].append(one_run(lab, remote, urls[cond], bulk=cond != "alone"))
                run = runs[cond][-1]
                print(f"{rate} round {r + 1} {cond}: anchor {run['anchor_ready_s']:.3f} s, residual "
                      f"{run['residual_ready_s']:.3f} s", file=sys.stderr, flush=True)
        # the marked load's bytes on the wire (headers included), to take out of the unmarked runs' default class
        wire = statistics.median(r["classes"]["anchor"] + r["classes"]["residual"] for r in runs["bulk"])
        rows += [row_of(rate, parse_rate(rate), c, runs[c], runs["alone"], wire) for c in CONDITIONS]
    return rows


def print_table(rows: list[dict], a, anchor_bytes: int) -> None:
    print(f"anchor {anchor_bytes:,} B, residual requested with it; medians (min–max) of {a.repeats} interleaved "
          f"rounds on the network lab's link, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    markdown_table(
        ["link", "condition", "anchor bytes / rate, s", "anchor ready, s", "ready / (bytes / rate)", "vs alone",
         "first anchor byte, ms", "residual MB in at the anchor", "residual ready, s", "bulk Mbit/s during the load"],
        [[r["rate"], r["condition"], f"{r['ideal_s']:.3f}", fmt(r["anchor_s"], ".3f"), fmt(r["ratio"], ".3f"),
          fmt(r["vs_alone"], ".3f"), fmt(r["first_ms"], ".0f"), fmt(r["residual_at_anchor_mb"], ".1f"),
          fmt(r["residual_s"]), fmt(r["bulk_mbit"], ".0f")] for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="60Mbps,200Mbps", help="comma-separated link rates")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every condition, interleaved")
    ap.add_argument("--tokens", type=int, default=3000, help="the built-in prompt's length for the cache")
    ap.add_argument("--cache", default=None, help="serve this cache instead of encoding one")
    ap.add_argument("--json", dest="json_out", default=None, help="also write every row and run here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(Reader)
    from lynxkv.bench.netlab import NetLab, can_create_lab

    if (reason := can_create_lab()) is not None:
        raise SystemExit(f"cannot build the network lab: {reason}")
    # the processes' own output (encode's, the servers' request logs): kept only if the run fails
    log = tempfile.NamedTemporaryFile("w", prefix="bench_anchor_under_bulk.", suffix=".log", delete=False)
    with log, tempfile.TemporaryDirectory() as d, NetLab(rate=a.rates.split(",")[0]) as lab:
        cache = Path(a.cache) if a.cache else encode(Path(d), a.tokens, log)
        remote = Remote(lab, log, __file__)
        try:
            with lynx_serve(lab, cache, log) as marked, lynx_serve(lab, cache, log, marks=False) as plain:
                urls = {"alone": marked["url"], "bulk": marked["url"], "bulk, unmarked": plain["url"]}
                rows = measure(lab, remote, urls, a)
        finally:
            remote.close()
    os.unlink(log.name)
    print_table(rows, a, rows[0]["runs"][0]["anchor_bytes"])
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
