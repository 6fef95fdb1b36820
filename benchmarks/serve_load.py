"""`lynxkv serve` under load: many concurrent clients, a share of them slow or idle, for minutes.

One `lynxkv serve` process (the CLI, `--port 0 --json`) serves a cache written with `lynxkv.cache.save_cache`.
*Fast* clients (this process, asyncio, one keep-alive connection each) ask for random byte ranges of the anchor
and the residual (`Range: bytes=a-b`, up to `--max-range` bytes, a random pause of mean `--think` s between
requests) and compare every byte with the files on disk. *Slow* clients (a second process) ask for a whole
resource and read it at `--slow-rate` bytes/s through a 4 KiB receive window; *idle* clients open a connection and
send nothing (half of them) or half a request header, one more header byte every few seconds (slowloris).
A slow or idle client that the server closes opens a new connection.

Phases, one after the other on the same server: fast clients alone (`--baseline-seconds`), fast clients with the
slow and idle ones (`--seconds`), fast clients alone again. The table gives, per phase, the fast clients'
requests, wrong bytes, failed requests, p50/p99 latency, and the server's peak RSS (VmRSS sampled every 0.25 s
from /proc); then the loaded p99 over the unloaded one (both unloaded phases pooled), and the server's own
counters (connections refused and closed by its limits, peak bytes queued), which it prints as JSON on exit.

    python benchmarks/serve_load.py --clients 500 --slow-share 0.3 --idle-share 0.2 --seconds 120
    python benchmarks/serve_load.py --clients 40 --seconds 10 --baseline-seconds 5      # a quick look
    python benchmarks/serve_load.py ... --serve-arg=--max-connections=300                 # flags for the server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HEADER_END = b"\r\n\r\n"


# ------------------------------------------------------------------------------------------------ the server


def make_cache(directory: Path, tokens: int) -> Path:
    import torch

    from lynxkv.cache import save_cache

    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(8, tokens, 128, generator=g), torch.randn(8, tokens, 128, generator=g)) for _ in range(4)]
    path = directory / "x.lynx"
    save_cache(path, kv, prompt_token_ids=list(range(16)))
    return path


def start_server(path: Path, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "lynxkv", "serve", str(path), "--port", "0", "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    while not lines or lines[-1] != "}\n":
        lines.append(proc.stdout.readline())
        if not lines[-1]:
            raise SystemExit(f"lynxkv serve did not start: {proc.stderr.read()}")
    threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # drain its log
    return proc, json.loads("".join(lines))


def stop_server(proc: subprocess.Popen) -> dict | None:
    """SIGTERM, then the counters the server prints as JSON on exit (None when it prints none)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None
    text = out.strip()
    if text.endswith("}") and "{" in text:
        try:
            return json.loads(text[text.index("{"):])
        except ValueError:
            return None
    return None


class RSSSampler(threading.Thread):
    """VmRSS of one process every 0.25 s, tagged with the phase it was taken in."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.phase, self.samples, self.hwm = pid, "start", [], 0
        self._halt = threading.Event()

    def _status(self) -> dict:
        with open(f"/proc/{self.pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS",
                                                                                                  "VmHWM")}

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                st = self._status()
            except (OSError, ValueError):
                return
            self.samples.append((self.phase, st["VmRSS"]))
            self.hwm = st["VmHWM"]
            self._halt.wait(0.25)

    def peak(self, phase: str) -> int:
        return max((r for p, r in self.samples if p == phase), default=0)

    def halves(self, phase: str) -> tuple[int, int]:
        """Peak RSS in the first and in the second half of a phase: growth shows as a second larger than the
        first."""
        xs = [r for p, r in self.samples if p == phase]
        h = len(xs) // 2
        return max(xs[:h], default=0), max(xs[h:], default=0)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


# ---------------------------------------------------------------------------------------------- fast clients


class Resource:
    def __init__(self, url_path: str, data: bytes):
        self.path, self.data = url_path, data


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = await reader.readuntil(HEADER_END)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    return status, headers


async def ranged_get(conn, res: Resource, a: int, b: int) -> tuple[int, dict, bytes]:
    reader, writer = conn
    writer.write(f"GET {res.path} HTTP/1.1\r\nHost: lynx\r\nRange: bytes={a}-{b}\r\n\r\n".encode())
    status, headers = await asyncio.wait_for(read_head(reader), 60)
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 60)
    return status, headers, body


def count(out: dict, key: str) -> None:
    out["failed"][key] = out["failed"].get(key, 0) + 1


async def fast_client(port: int, resources: list[Resource], args, seed: int, until: float, out: dict) -> None:
    """Random ranges over one keep-alive connection; a request on a reused connection that the server closed
    meanwhile (an idle one making room at the connection cap) is sent again on a new one, as HTTP clients do."""
    rnd = random.Random(seed)
    conn = None
    while time.monotonic() < until:
        res = rnd.choice(resources)
        size = len(res.data)
        a = rnd.randrange(size)
        b = min(size, a + rnd.randint(1, args.max_range)) - 1
        t0 = time.perf_counter()
        try:
            for attempt in (0, 1):
                reused = conn is not None
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
                try:
                    status, headers, body = await ranged_get(conn, res, a, b)
                    break
                except (ConnectionError, asyncio.IncompleteReadError):
                    conn[1].close()
                    conn = None
                    if not reused or attempt:
                        raise
                    out["resent"] += 1
            dt = time.perf_counter() - t0
            if status != 206:
                count(out, str(status))
                conn[1].close()
                conn = None
            else:
                want = res.data[a:b + 1]
                if body != want or headers.get("content-range") != f"bytes {a}-{b}/{size}":
                    out["wrong_bytes"] += sum(x != y for x, y in zip(body, want)) + abs(len(want) - len(body))
                    out["wrong_responses"] += 1
                out["latency"].append(dt)
                out["bytes"] += len(body)
                if headers.get("connection", "").lower() == "close":
                    conn[1].close()
                    conn = None
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, IndexError) as exc:
            count(out, type(exc).__name__)
            if conn is not None:
                conn[1].close()
            conn = None
        await asyncio.sleep(rnd.expovariate(1 / args.think) if args.think > 0 else 0)
    if conn is not None:
        conn[1].close()


async def fast_phase(port: int, resources: list[Resource], args, n: int, seconds: float, seed: int) -> dict:
    out = {"latency": [], "bytes": 0, "wrong_bytes": 0, "wrong_responses": 0, "resent": 0, "failed": {}}
    until = time.monotonic() + seconds
    await asyncio.gather(*(fast_client(port, resources, args, seed * 100_000 + i, until, out) for i in range(n)))
    return out


# ----------------------------------------------------------------------------- slow and idle clients (a process)


async def slow_client(port: int, resources: list[tuple[str, bytes]], rate: float, until: float, seed: int,
                      out: dict) -> None:
    rnd = random.Random(seed)
    while time.monotonic() < until:
        path, data = rnd.choice(resources)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        got = bytearray()
        try:
            await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 30)
            await loop.sock_sendall(s, f"GET {path} HTTP/1.1\r\nHost: lynx\r\n\r\n".encode())
            out["slow_requests"] += 1
            step = max(1, int(rate))
            while time.monotonic() < until:
                # a reset stays behind the bytes already in the receive window: ask the socket for it
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    break
                chunk = await asyncio.wait_for(loop.sock_recv(s, step), 120)
                if not chunk:
                    break
                got += chunk
                await asyncio.sleep(1.0)
            out["slow_closed_by_server" if time.monotonic() < until else "slow_open_at_end"] += 1
        except (OSError, asyncio.TimeoutError):
            out["slow_closed_by_server"] += 1
        finally:
            s.close()
        if HEADER_END in got:
            head, body = bytes(got).split(HEADER_END, 1)
            if head.startswith(b"HTTP/1.1 200"):
                out["slow_wrong_bytes"] += sum(x != y for x, y in zip(body, data))
            else:
                out["slow_refused"] += 1
        await asyncio.sleep(0.5)


async def idle_client(port: int, partial: bool, until: float, out: dict) -> None:
    loop = asyncio.get_running_loop()
    while time.monotonic() < until:
        s = socket.socket()
        s.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 30)
            out["idle_connections"] += 1
            if partial:
                await loop.sock_sendall(s, b"GET /x.lynx HTTP/1.1\r\nHost: lynx\r\nX-a")
            while time.monotonic() < until:
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(s, 4096), 5.0)
                except asyncio.TimeoutError:
                    if partial:
                        await loop.sock_sendall(s, b"a")  # one more header byte now and then
                    continue
                if not chunk:
                    out["idle_closed_by_server"] += 1
                    break
        except (OSError, asyncio.TimeoutError):
            out["idle_closed_by_server"] += 1
        finally:
            s.close()
        await asyncio.sleep(0.5)


def load_process(port: int, resources: list[tuple[str, bytes]], n_slow: int, n_idle: int, rate: float,
                 seconds: float, ready, results) -> None:
    async def main() -> dict:
        out = dict.fromkeys(["slow_requests", "slow_closed_by_server", "slow_open_at_end", "slow_wrong_bytes",
                             "slow_refused", "idle_connections", "idle_closed_by_server"], 0)
        until = time.monotonic() + seconds
        tasks = [slow_client(port, resources, rate, until, i, out) for i in range(n_slow)]
        tasks += [idle_client(port, i % 2 == 1, until, out) for i in range(n_idle)]
        loop = asyncio.get_running_loop()
        loop.call_later(min(2.0, seconds / 4), ready.set)  # connected by then
        await asyncio.gather(*tasks)
        return out

    results.put(asyncio.run(main()))


# ------------------------------------------------------------------------------------------------------ main


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--slow-share", type=float, default=0.3)
    ap.add_argument("--idle-share", type=float, default=0.2)
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the loaded phase")
    ap.add_argument("--baseline-seconds", type=float, default=None, help="each unloaded phase (default: "
                    "a quarter of --seconds, at least 10)")
    ap.add_argument("--think", type=float, default=0.25, help="mean pause of a fast client between requests")
    ap.add_argument("--max-range", type=int, default=64 << 10, help="largest range a fast client asks for")
    ap.add_argument("--slow-rate", type=float, default=8, help="bytes per second a slow client reads")
    ap.add_argument("--tokens", type=int, default=1024, help="cache size: 4 layers x 8 heads x TOKENS x 128")
    ap.add_argument("--serve-arg", action="append", default=[], help="a flag for lynxkv serve (repeatable)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    n_slow = int(round(args.clients * args.slow_share))
    n_idle = int(round(args.clients * args.idle_share))
    n_fast = args.clients - n_slow - n_idle
    base_s = args.baseline_seconds or max(10.0, args.seconds / 4)

    d = Path(tempfile.mkdtemp(prefix="lynx-load-"))
    path = make_cache(d, args.tokens)
    files = [("/x.lynx", path.read_bytes()), ("/x.lynxr", (d / "x.lynxr").read_bytes())]
    resources = [Resource(p, data) for p, data in files]
    proc, info = start_server(path, args.serve_arg)
    port = info["port"]
    rss = RSSSampler(proc.pid)
    rss.start()
    phases: dict[str, dict] = {}
    load_out = None
    try:
        asyncio.run(fast_phase(port, resources, args, min(n_fast, 8), 2.0, seed=0))  # warm-up
        rss.phase = "unloaded (before)"
        phases[rss.phase] = asyncio.run(fast_phase(port, resources, args, n_fast, base_s, seed=1))
        ctx = multiprocessing.get_context("spawn")
        ready, results = ctx.Event(), ctx.Queue()
        loader = ctx.Process(target=load_process, args=(port, files, n_slow, n_idle, args.slow_rate,
                                                         args.seconds + 2.0, ready, results))
        loader.start()
        ready.wait(30)
        rss.phase = "loaded"
        phases[rss.phase] = asyncio.run(fast_phase(port, resources, args, n_fast, args.seconds, seed=2))
        load_out = results.get(timeout=120)
        loader.join(30)
        time.sleep(1.0)
        rss.phase = "unloaded (after)"
        phases[rss.phase] = asyncio.run(fast_phase(port, resources, args, n_fast, base_s, seed=3))
    finally:
        rss.stop()
        server_stats = stop_server(proc)

    sizes = ", ".join(f"{p} {len(b) / 1e6:.1f} MB" for p, b in files)
    print(f"lynxkv serve {' '.join(args.serve_arg)} on {os.cpu_count()} cores; cache {sizes}; {args.clients} "
          f"clients: {n_fast} fast (ranges <= {args.max_range >> 10} KiB, think {args.think} s), {n_slow} slow "
          f"({args.slow_rate:g} B/s), {n_idle} idle (half slowloris)")
    print(f"{'phase':<18} {'s':>5} {'requests':>9} {'MB':>7} {'wrong B':>8} {'failed':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'RSS MB':>8}")
    for name, ph in phases.items():
        s = args.seconds if name == "loaded" else base_s
        print(f"{name:<18} {s:5.0f} {len(ph['latency']):9d} {ph['bytes'] / 1e6:7.1f} {ph['wrong_bytes']:8d} "
              f"{sum(ph['failed'].values()):7d} {pct(ph['latency'], 0.5) * 1e3:8.1f} "
              f"{pct(ph['latency'], 0.99) * 1e3:8.1f} {rss.peak(name) / 1e6:8.1f}")
    unloaded = phases["unloaded (before)"]["latency"] + phases["unloaded (after)"]["latency"]
    ratio = pct(phases["loaded"]["latency"], 0.99) / pct(unloaded, 0.99)
    print(f"fast clients' p99, loaded / unloaded (both unloaded phases pooled): {ratio:.2f}")
    h1, h2 = rss.halves("loaded")
    print(f"server RSS: {rss.peak('start') / 1e6:.1f} MB at start, peak {rss.hwm / 1e6:.1f} MB (VmHWM); loaded "
          f"phase peak {h1 / 1e6:.1f} MB in its first half, {h2 / 1e6:.1f} MB in its second")
    for name, ph in phases.items():
        if ph["failed"] or ph["resent"]:
            print(f"{name}: failed fast requests by cause {ph['failed']}, sent again on a new connection "
                  f"{ph['resent']}")
    print(f"slow and idle clients: {load_out}")
    print(f"server counters: {server_stats}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "ratio_p99": ratio, "rss_hwm": rss.hwm, "rss_loaded_halves": [h1, h2],
            "server": server_stats, "load": load_out,
            "phases": {k: {**{x: v for x, v in ph.items() if x != "latency"}, "requests": len(ph["latency"]),
                           "p50": pct(ph["latency"], 0.5), "p99": pct(ph["latency"], 0.99)}
                       for k, ph in phases.items()}}, indent=2))


if __name__ == "__main__":
    main()
