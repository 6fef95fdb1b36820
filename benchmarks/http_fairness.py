"""How much an idle or hostile client delays another one on `lynxkv serve` (HTTP), side by side.

One server on loopback paces everything it sends to `--rate` (default 200 Mbit/s, strict anchor priority). A
*victim* loads the whole cache progressively (`open_progressive(url, decode=False)`, the client `lynxkv stream`
uses). Its time to the last residual byte is measured alone and next to each attacker; the table prints medians of
`--repeats` runs and the ratio to the victim alone (the target: at most 1.10).

Attackers (each bounded, loopback only):
- idle-anchor: asks for the anchor and never reads a byte (the old TCP server's starvation case);
- 300-idle: 300 connections that never send a request;
- slowloris: 20 connections that send half a request and stop;
- drops: a client that starts 10 anchor downloads and resets each mid-body;
- 10-readers: 10 other clients loading the same cache at the same time (fair sharing: about 11x expected, shown
  for scale, not an attack).

    python benchmarks/http_fairness.py [--rate 200Mbps] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures_s3 import synthetic_cache_bytes, write_pair  # noqa: E402

from lynxkv.stream import open_progressive  # noqa: E402
from lynxkv.serve import CacheServer, load_served_cache  # noqa: E402
from lynxkv.stream.units import parse_bandwidth  # noqa: E402


def victim(url: str) -> float:
    t0 = time.perf_counter()
    with open_progressive(url, decode=False) as load:
        load.residual.result(120)
    return time.perf_counter() - t0


def idle_anchor(srv: CacheServer, stop: threading.Event) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(f"GET /{srv.cache.anchor.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    stop.wait()
    s.close()


def idle_connections(n: int, half_request: bool):
    def run(srv: CacheServer, stop: threading.Event) -> None:
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", srv.port))
            if half_request:
                s.sendall(b"GET /x.lynx HTTP/1.1\r\nHo")
            socks.append(s)
        stop.wait()
        for s in socks:
            s.close()
    return run


def drops(srv: CacheServer, stop: threading.Event) -> None:
    for _ in range(10):
        if stop.is_set():
            return
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(f"GET /{srv.cache.anchor.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        s.recv(200_000)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()


def readers(n: int):
    def run(srv: CacheServer, stop: threading.Event) -> None:
        ts = [threading.Thread(target=victim, args=(srv.url,)) for _ in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return run


ATTACKS = {"idle-anchor": idle_anchor, "300-idle": idle_connections(300, False),
           "slowloris": idle_connections(20, True), "drops": drops, "10-readers": readers(10)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="200Mbps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rate = parse_bandwidth(args.rate)
    d = Path(tempfile.mkdtemp(prefix="lynx-fair-"))
    anchor, residual = synthetic_cache_bytes(layers=4, heads=4, tokens=2048, dim=128)
    path = write_pair(d, anchor, residual)
    size = len(anchor) + len(residual)
    rows = {}
    with CacheServer(load_served_cache(path), bandwidth=rate, idle_timeout=30) as srv:
        victim(srv.url)  # warm-up
        alone = [victim(srv.url) for _ in range(args.repeats)]
        rows["alone"] = alone
        for name, attack in ATTACKS.items():
            samples = []
            for _ in range(args.repeats):
                stop = threading.Event()
                t = threading.Thread(target=attack, args=(srv, stop), daemon=True)
                t.start()
                time.sleep(0.2)  # the attack is in place before the victim starts
                samples.append(victim(srv.url))
                stop.set()
                t.join(120)
            rows[name] = samples
    base = statistics.median(alone)
    print(f"cache {size / 1e6:.1f} MB ({len(anchor) / 1e6:.1f} MB anchor), server paced at {args.rate}; "
          f"victim = open_progressive(url, decode=False), median of {args.repeats}")
    print(f"{'attacker':<12} {'victim s':>9} {'ratio':>7}")
    for name, samples in rows.items():
        m = statistics.median(samples)
        print(f"{name:<12} {m:9.3f} {m / base:7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": rate, "bytes": size, "samples": rows}, indent=2))


if __name__ == "__main__":
    main()
