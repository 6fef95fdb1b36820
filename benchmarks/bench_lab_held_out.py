"""Lynx against monolithic transfers on held-out prompts, end to end across a real shaped link (the network lab).

    sudo .venv/bin/python benchmarks/bench_lab_held_out.py --prompts 1 --repeats 3 --rates 12Mbps,60Mbps,200Mbps,1Gbps

The prompts are those of ``benchmarks/bench_held_out.py`` (its ``held_out_prompts``: the held-out corpus of
``lynxkv eval``), ``--tokens`` long, each encoded beforehand with SmolLM2 (as ``lynxkv encode --model smollm2
--prompt-file``) and also written as the BF16 safetensors of its full code (as ``lynxkv decode --dtype bf16``).
The server namespace of a :class:`lynxkv.bench.netlab.NetLab` runs ``lynxkv serve`` of the finished cache (anchor
EF, residual CS1) and a plain static HTTP server for the safetensors file; the cache is served finished, not by
``lynxkv prefill`` while it is encoded, so that every method starts from the same point (a cache that exists)
and the prefill's compute is no part of any figure. The client namespace runs one decoder process that loads the
model once and, for each run, makes the Python calls ``lynxkv run`` makes:

- ``lynx``: ``open_progressive(URL, room=...)`` and the engine (draft on the anchor, verify), exactly as
  ``lynxkv run URL --ignore-eos -n 64``; the first prompt's first rate also runs the ``lynxkv run`` command itself
  once and checks its tokens;
- ``full``: the anchor and residual files fetched whole over HTTP, then decoded plainly on the full code (the
  engine with ``speculate=False`` over the fetched files);
- ``bf16``: the safetensors file fetched whole, then decoded plainly on it.

Every time runs from the moment the decoder starts to fetch. Methods run in rounds, the order rotated each round;
the lab's link is set to each ``--rates`` rate in turn (nothing tells lynxkv the rate). One row per prompt and
rate, medians with min-max over the rounds: TT1 and TT64 per method, the drafts kept (main chain plus branch), the
gain (TT64 full - TT64 lynx), TT64 lynx / full, TT64 lynx / bf16, and gain / (kept drafts x decode step): what the
run keeps of what its kept drafts are worth. Lynx and the full code must give the same tokens (greedy, fp32); the
BF16 run's tokens are reported (rounding can flip a near-tie). The server processes share the machine's cores
with the decoder. ``--json PATH`` writes every run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_held_out import held_out_prompts  # noqa: E402 - the same held-out prompts as the emulated benchmark

NEW = 64
METHODS = ("lynx", "full", "bf16")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


# ---- the decoder, in the client namespace ------------------------------------------------------------------------

def fetch(url: str, into: Path) -> int:
    """GET ``url`` whole into the file ``into``; the bytes received."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        conn.request("GET", u.path)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {resp.status}")
        n = 0
        with open(into, "wb") as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                n += len(chunk)
        return n
    finally:
        conn.close()


def summary(result, fetched_s: float | None = None, nbytes: int | None = None) -> dict:
    s = result.stats
    return {"token_ids": result.token_ids, "tt1_s": s.tt(1), f"tt{NEW}_s": s.tt(NEW), "verified": s.verified,
            "drafted": s.drafted, "accepted": s.accepted, "branch_accepted": s.branch_accepted,
            "decode_step_s": s.decode_step_s, "anchor_ready_s": s.anchor_ready_s,
            "residual_ready_s": s.residual_ready_s, "fetched_s": fetched_s, "fetched_bytes": nbytes}


class Decoder:
    """The model, loaded once, and one run of each method (``lynxkv run``'s calls)."""

    def __init__(self, scratch: Path):
        from lynxkv.hf.models import load_model
        from lynxkv.speculative import RunConfig

        self.lm = load_model()
        self.cfg = RunConfig(max_new_tokens=NEW)  # no stop token (--ignore-eos): NEW tokens every time
        self.scratch = scratch
        self.timing = None
        self.ids: list[int] = []

    def prompt(self, ids: list[int]) -> dict:
        from lynxkv.speculative import Timing

        self.ids, self.timing = ids, Timing()  # as lynxkv run: a step timed at the prompt's length, before loads
        return {"step_s": self.timing.calibrate(self.lm.model, len(ids))}

    def lynx(self, url: str) -> dict:
        from lynxkv.speculative import run
        from lynxkv.stream.progressive import open_progressive

        started = time.perf_counter()
        load = open_progressive(url, room=NEW + 1)
        try:
            return summary(run(self.lm.model, load, self.cfg, fingerprint=self.lm.fingerprint, started_at=started,
                               timing=self.timing))
        finally:
            load.close()

    def full(self, anchor_url: str, residual_url: str) -> dict:
        """Both files whole, then the engine without drafting over the local copy (read in place)."""
        from lynxkv.stream.progressive import open_progressive

        anchor = self.scratch / Path(urlsplit(anchor_url).path).name
        started = time.perf_counter()
        nbytes = fetch(anchor_url, anchor) + fetch(residual_url, self.scratch / Path(urlsplit(residual_url).path).name)
        fetched = time.perf_counter() - started
        return self._plain(open_progressive(str(anchor), room=NEW + 1), started, fetched, nbytes)

    def bf16(self, url: str) -> dict:
        """The safetensors file whole, its tensors into fp32 buffers with room, then plain decoding."""
        import torch

        from lynxkv.cache.dumps import load_kv_safetensors
        from lynxkv.cache.loading import PreparedLoad

        path = self.scratch / "kv.safetensors"
        started = time.perf_counter()
        nbytes = fetch(url, path)
        fetched = time.perf_counter() - started

        def roomy(x: torch.Tensor) -> torch.Tensor:
            h, t, d = x.shape
            out = torch.empty((h, t + NEW + 1, d), dtype=torch.float32)[:, :t, :]
            return out.copy_(x)

        kv = [(roomy(k), roomy(v)) for k, v in load_kv_safetensors(path)[0]]
        load = PreparedLoad(kv, kv, prompt_token_ids=self.ids, model_fingerprint=self.lm.fingerprint,
                            anchor_bytes=nbytes, grow_in_place=True)
        return self._plain(load, started, fetched, nbytes)

    def _plain(self, load, started: float, fetched: float, nbytes: int) -> dict:
        """Plain decoding (no drafts) on a fetched cache, timed from ``started`` (the fetch's start)."""
        from dataclasses import replace

        from lynxkv.speculative import run

        try:
            result = run(self.lm.model, load, replace(self.cfg, speculate=False), fingerprint=self.lm.fingerprint,
                         started_at=started, timing=self.timing)
        finally:
            load.close()
        return summary(result, fetched, nbytes)


def worker(make=Decoder) -> int:
    """Commands on stdin, one JSON object a line (``{"op": ..., "args": [...]}``), each a call of that method of
    ``make(scratch folder)``; one JSON answer a line."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the answers
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        dec = make(Path(d))
        print(json.dumps({"ready": True}), file=out, flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            try:
                answer = getattr(dec, cmd["op"])(*cmd["args"])
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), file=out, flush=True)
    return 0


# ---- the driver --------------------------------------------------------------------------------------------------

class Remote:
    """The worker process of ``script`` (``script --worker`` runs :func:`worker`; by default this file's, the
    decoder) in the client namespace, one command at a time."""

    def __init__(self, lab, log, script: str = __file__):
        self.log = log
        self.proc = lab.popen("client", [sys.executable, script, "--worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
        self._answer()

    def call(self, op: str, *args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the decoder process ended (its log: {self.log.name})")
        answer = json.loads(line)
        if "error" in answer:
            raise SystemExit(f"the decoder failed: {answer['error']}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):  # else the lab stops it
            self.proc.wait(timeout=30)


def prepare(paths: list[Path], d: Path) -> list[tuple[Path, Path, list[int]]]:
    """Each prompt encoded (``lynxkv encode --model smollm2 --prompt-file``) and its full code as BF16 safetensors
    (``lynxkv decode --dtype bf16``): ``(cache, safetensors, prompt ids)``."""
    import torch

    from lynxkv.cache import open_cache
    from lynxkv.cache.dumps import write_kv_safetensors
    from lynxkv.hf.encoding import encode_model
    from lynxkv.quant.scheme import get_scheme

    out = []
    (d / "bf16").mkdir()
    for i, prompt in enumerate(paths, 1):
        cache, dump = d / f"h{i}.lynx", d / "bf16" / f"h{i}.safetensors"
        encode_model(None, cache, get_scheme("default"), prompt=prompt.read_text(), dtype=torch.float32)
        with open_cache(str(cache)) as c:
            info = c.info
            write_kv_safetensors(dump, c.iter_layers(dtype=torch.bfloat16), layers=info.layers,
                                 shape=(info.kv_heads, info.tokens, info.head_dim), dtype=torch.bfloat16,
                                 names=info.names, batched=info.batch_dim)
            out.append((cache, dump, list(info.prompt_token_ids)))
        print(f"p{i}: {info.tokens} tokens; anchor {info.anchor_bytes:,} B, residual {info.residual_bytes:,} B, "
              f"bf16 {dump.stat().st_size:,} B", file=sys.stderr, flush=True)
    return out


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=10)
    proc.kill()


@contextlib.contextmanager
def lynx_serve(lab, cache: Path, log, *, marks: bool = True):
    """``lynxkv serve`` of ``cache`` in the server namespace, with ``marks`` anchor EF and residual CS1 (else
    unmarked): what ``serve --json`` printed as it started (``url``, ``residual`` ...)."""
    dscp = ["--dscp-anchor", "EF", "--dscp-residual", "CS1"] if marks else []
    serve = lab.popen("server", [sys.executable, "-m", "lynxkv", "serve", cache, "--host", lab.server_addr, "--port",
                                 "0", "--json", *dscp], stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    try:
        lines: list[str] = []
        while not lines or lines[-1] != "}\n":
            lines.append(serve.stdout.readline())
            if not lines[-1]:
                raise SystemExit(f"lynxkv serve did not start (its log: {log.name})")
        yield json.loads("".join(lines))
    finally:
        _stop(serve)


@contextlib.contextmanager
def servers(lab, cache: Path, static_dir: Path, log):
    """``lynxkv serve`` of ``cache`` (anchor EF, residual CS1) and a static HTTP server of ``static_dir``, in the
    server namespace: ``(anchor URL, residual URL, static base URL)``."""
    with lynx_serve(lab, cache, log) as info:
        static = lab.popen("server", [sys.executable, "-u", "-m", "http.server", "0", "--bind", lab.server_addr,
                                      "--directory", static_dir], stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            port = re.search(r"port (\d+)", static.stdout.readline())
            if port is None:
                raise SystemExit(f"the static server did not start (its log: {log.name})")
            base = info["url"].rsplit("/", 1)[0]
            yield info["url"], f"{base}/{info['residual']['path']}", f"http://{lab.server_addr}:{port[1]}"
        finally:
            _stop(static)


def spread(xs) -> tuple | None:
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def row_of(prompt: str, rate: str, runs: dict[str, list[dict]]) -> dict:
    """Medians with min-max over the rounds; the ratios and the gain are taken round by round."""
    tt = f"tt{NEW}_s"
    rounds = []
    for lynx, full, bf16 in zip(runs["lynx"], runs["full"], runs["bf16"]):
        kept = lynx["accepted"] + (lynx["branch_accepted"] or 0)
        gain = full[tt] - lynx[tt]
        worth = kept * full["decode_step_s"] if full["decode_step_s"] else None
        rounds.append({"kept": kept, "gain_s": gain, "vs_full": lynx[tt] / full[tt], "vs_bf16": lynx[tt] / bf16[tt],
                       "gain_of_worth": gain / worth if worth else None})
    row = {"prompt": prompt, "rate": rate, "rounds": rounds, "runs": runs}
    for m in METHODS:
        row[f"tt1_{m}"] = spread(r["tt1_s"] for r in runs[m])
        row[f"tt{NEW}_{m}"] = spread(r[tt] for r in runs[m])
    for k in ("kept", "gain_s", "vs_full", "vs_bf16", "gain_of_worth"):
        row[k] = spread(r[k] for r in rounds)
    row["step_ms"] = spread(r["decode_step_s"] * 1e3 for r in runs["full"] if r["decode_step_s"])
    row["fetch_mbit"] = spread(r["fetched_bytes"] * 8 / r["fetched_s"] / 1e6 for r in runs["full"])
    first = runs["lynx"][0]["token_ids"]
    row["verified"] = all(r["verified"] for r in runs["lynx"])
    row["same_full"] = all(r["token_ids"] == first for m in ("lynx", "full") for r in runs[m])
    row["same_bf16"] = sum(r["token_ids"] == first for r in runs["bf16"])
    return row


def fmt(s, spec=".2f") -> str:
    if s is None:
        return "-"
    med, lo, hi = s
    return f"{med:{spec}} ({lo:{spec}}–{hi:{spec}})"


def markdown_table(columns: list[str], rows: list[list[str]]) -> None:
    """Print a Markdown table."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def print_table(rows: list[dict], a) -> None:
    print(f"{a.prompts} held-out ~{a.tokens}-token prompts, SmolLM2 fp32, {NEW} tokens, the network lab's link; "
          f"medians (min–max) of {a.repeats} interleaved rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    markdown_table(
        ["prompt", "rate", "full fetch Mbit/s", "TT1 lynx", "TT1 full", "TT1 bf16", f"TT{NEW} lynx", f"TT{NEW} full",
         f"TT{NEW} bf16", "kept drafts", "decode step ms", "gain s", f"TT{NEW} lynx / full", "lynx / bf16",
         "gain / (kept x step)", "same tokens (full; bf16)"],
        [[r["prompt"], r["rate"], fmt(r["fetch_mbit"], ".0f"), fmt(r["tt1_lynx"]), fmt(r["tt1_full"]),
          fmt(r["tt1_bf16"]), fmt(r[f"tt{NEW}_lynx"]), fmt(r[f"tt{NEW}_full"]), fmt(r[f"tt{NEW}_bf16"]),
          fmt(r["kept"], ".0f"), fmt(r["step_ms"], ".0f"), fmt(r["gain_s"]), fmt(r["vs_full"], ".3f"),
          fmt(r["vs_bf16"], ".3f"), fmt(r["gain_of_worth"]),
          f"{'yes' if r['same_full'] and r['verified'] else 'NO'}; {r['same_bf16']}/{a.repeats}"] for r in rows])
    for rate in a.rates.split(","):
        mine = [r["vs_full"][0] for r in rows if r["rate"] == rate]
        print(f"{rate}: TT{NEW} lynx / full, median over prompts {statistics.median(mine):.3f} "
              f"(min {min(mine):.3f}, max {max(mine):.3f}, {len(mine)} prompts)")


def cli_check(lab, url: str, expected: list[int]) -> None:
    """``lynxkv run URL`` itself, once: the same tokens as the decoder process's Lynx run."""
    proc = lab.run("client", [sys.executable, "-m", "lynxkv", "run", url, "--ignore-eos", "-n", str(NEW), "--json"],
                   timeout=600, check=False, env=ENV)
    if proc.returncode != 0:
        raise SystemExit(f"lynxkv run {url} failed: {proc.stderr.strip()[-2000:]}")
    same = json.loads(proc.stdout)["token_ids"] == expected
    print(f"lynxkv run {url} (the command): {'the same tokens' if same else 'OTHER TOKENS'}", file=sys.stderr,
          flush=True)
    if not same:
        raise SystemExit("lynxkv run gave other tokens than the decoder process's Lynx run")


def measure(lab, remote: Remote, prepared, a, d: Path, log) -> list[dict]:
    rows = []
    rates = a.rates.split(",")
    for i, (cache, _, ids) in enumerate(prepared, 1):
        with servers(lab, cache, d / "bf16", log) as (url, residual_url, static):
            remote.call("prompt", ids)
            for rate in rates:
                lab.set_rate(rate)
                runs: dict[str, list[dict]] = {m: [] for m in METHODS}
                for r in range(a.repeats):
                    for m in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
                        args = {"lynx": (url,), "full": (url, residual_url),
                                "bf16": (f"{static}/h{i}.safetensors",)}[m]
                        runs[m].append(remote.call(m, *args))
                if i == 1 and rate == rates[0] and not a.no_cli_check:
                    cli_check(lab, url, runs["lynx"][0]["token_ids"])
                rows.append(row_of(f"p{i}", rate, runs))
                r = rows[-1]
                print(f"p{i} {rate}: TT{NEW} lynx {fmt(r[f'tt{NEW}_lynx'])} s, full {fmt(r[f'tt{NEW}_full'])} s, "
                      f"bf16 {fmt(r[f'tt{NEW}_bf16'])} s", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rates", default="12Mbps,60Mbps,200Mbps,1Gbps", help="comma-separated link rates")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every method, interleaved")
    ap.add_argument("--no-cli-check", action="store_true", help="skip the one run of the lynxkv run command")
    ap.add_argument("--json", dest="json_out", default=None, help="also write every row and run here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker()
    from lynxkv.bench.netlab import NetLab, can_create_lab

    if (reason := can_create_lab()) is not None:
        raise SystemExit(f"cannot build the network lab: {reason}")
    # the processes' own output (the servers' request logs, the decoder's warnings): kept only if the run fails
    log = tempfile.NamedTemporaryFile("w", prefix="bench_lab_held_out.", suffix=".log", delete=False)
    with log, tempfile.TemporaryDirectory() as d, NetLab(rate=a.rates.split(",")[0]) as lab:
        d = Path(d)
        remote = Remote(lab, log)  # loads the model while the prompts are encoded
        try:
            prepared = prepare(held_out_prompts(a.prompts, a.tokens, d), d)
            rows = measure(lab, remote, prepared, a, d, log)
        finally:
            remote.close()
    os.unlink(log.name)
    print_table(rows, a)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
