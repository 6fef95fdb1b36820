"""When does the anchor of a prefill still being published land at a decoder across a real shaped link?

``lynxkv prefill`` runs in a network lab's server namespace (lynxkv.bench.netlab) and starts its prefill when the
first client asks; a reader in the client namespace opens the URL at once (``open_progressive``) and records when
the anchor is ready (every anchor page in, checked and dequantized) and when the residual is. Both clocks are
the host's (``time.time``), so the anchor's readiness is measured from the prefill's start. The link's rate is
used only to report ``anchor bytes / rate``: lynxkv is not told it.

    sudo python benchmarks/bench_disaggregated.py --rate 40Mbit --tokens 1000 [--model smollm2] [--repeats 3]

Prints one row per run and writes JSON (``--json PATH``): prefill forward time, anchor bytes, anchor_bytes / rate,
the anchor's readiness at the decoder, and its ratio to max(prefill, transfer) and to their sum.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from lynxkv.bench.netlab import NetLab, can_create_lab
from lynxkv.bench.shaping import parse_rate

READER = r"""
import json, sys, time
from lynxkv.stream.progressive import open_progressive
t_open = time.time()
load = open_progressive(sys.argv[1])
load.wait_anchor(300)
t_anchor = time.time()
load.residual.result(300)
t_residual = time.time()
load.close()
print(json.dumps({"open": t_open, "anchor": t_anchor, "residual": t_residual}))
"""


def one_run(lab: NetLab, model: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "lynxkv", "prefill", "--model", model, "--tokens", str(tokens), "--host",
           lab.server_addr, "--port", "0", "--start-on-request", "--json", "--dscp-anchor", "EF",
           "--dscp-residual", "CS1"]
    proc = lab.popen("server", cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        while not lines or lines[-1] != "}\n":
            lines.append(proc.stdout.readline())
            if not lines[-1]:
                raise SystemExit(proc.stderr.read())
        url = json.loads("".join(lines))["url"]
        reader = lab.run("client", [sys.executable, "-c", READER, url], timeout=600, check=False)
        if reader.returncode != 0:
            raise SystemExit(f"the reader failed: {reader.stderr}")
    finally:
        proc.terminate()  # after the reader: a block it read again must still find the server (no --once)
        rest, _ = proc.communicate(timeout=60)
    published = json.loads(rest)["published"]
    return {"published": published, "reader": json.loads(reader.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="40Mbit")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if (reason := can_create_lab()) is not None:
        raise SystemExit(f"cannot build the network lab: {reason}")
    bits = parse_rate(args.rate)
    rows = []
    with NetLab(rate=args.rate) as lab:
        for _ in range(args.repeats):
            r = one_run(lab, args.model, args.tokens)
            p, rd = r["published"], r["reader"]
            transfer = p["anchor_bytes"] * 8 / bits
            ready = rd["anchor"] - p["started_at"]
            prefill = p["kv_s"]  # the prefill's KV complete (its last layer has run)
            row = {"tokens": p["tokens"], "prefill_s": prefill, "forward_s": p["forward_s"],
                   "anchor_final_s": p["anchor_s"],
                   "anchor_bytes": p["anchor_bytes"], "transfer_s": transfer, "anchor_ready_s": ready,
                   "residual_ready_s": rd["residual"] - p["started_at"],
                   "ratio_to_max": ready / max(prefill, transfer), "ratio_to_sum": ready / (prefill + transfer)}
            rows.append(row)
            print(f"prefill {prefill:.2f} s, anchor {row['anchor_bytes'] / 1e6:.2f} MB / {args.rate} = "
                  f"{transfer:.2f} s; anchor ready at the decoder {ready:.2f} s = {row['ratio_to_max']:.2f} x max, "
                  f"{row['ratio_to_sum']:.2f} x sum; residual {row['residual_ready_s']:.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "model": args.model, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
