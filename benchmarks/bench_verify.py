"""The verify pass on the critical path: its cost in decode steps, and when the first token comes, per runner setting.

    .venv/bin/python benchmarks/bench_verify.py --tokens 3000 --bandwidth 60Mbps --repeats 3

Encodes the built-in prompt with the offline SmolLM2 (``lynxkv encode``), then runs ``lynxkv run CACHE --bandwidth R
-n 64 --ignore-eos --json`` once per setting per round, the settings interleaved, ``--repeats`` rounds:

- ``before``: the verify's attention as ``transformers`` runs it (``LYNXKV_GROUPED_SDPA=0``: every key and value
  head copied once per query head before a masked multi-token forward) and the residual dequantized once it is
  all in (``LYNXKV_EAGER_RESIDUAL=0``);
- ``grouped``: lynxkv's grouped-query SDPA (:mod:`lynxkv.hf.attention`), the residual still dequantized at the end;
- ``grouped, eager``: and the residual dequantized layer by layer as it lands, at the lowest CPU priority
  (:mod:`lynxkv.stream.assembly`);
- ``grouped, eager, layered (the defaults)``: and the verify forward run layer by layer as the residual's layers
  land (:mod:`lynxkv.speculative.layered`); every other setting but ``first`` and ``layered`` passes
  ``--no-layered-verify``, so it stays the runner it names;
- ``grouped, eager, --verify-first N``: and the first N drafts verified and committed in a pass of their own (which
  turns the layered verify off);
- ``no interrupt`` (only with ``--settings``): the defaults, but a draft step under way when the residual lands runs
  to its end (``LYNXKV_INTERRUPT_DRAFTS=0``; by default it is abandoned part-way, :mod:`lynxkv.speculative.interrupt`)
  and the runner neither dequantizes landed residual layers between draft steps nor stops drafting when the last
  byte is in (``LYNXKV_DEQUANT_BETWEEN_DRAFTS=0``): the runner before both;
- ``no dequantizing between drafts`` (only with ``--settings``): the defaults with ``LYNXKV_DEQUANT_BETWEEN_DRAFTS=0``;
- ``--no-layered-verify`` (only with ``--settings``): the defaults with the verify after the whole residual;
- ``--layered-verify`` (only with ``--settings``): the layered verify asked for explicitly (the defaults' setting).

``--settings`` picks which run, by key: ``before``, ``grouped``, ``defaults``, ``first``, ``nointerrupt``,
``nobetween``, ``nolayered``, ``layered`` (default: the first four).

Per setting, medians over the rounds: drafts kept, the verify's seconds and its length in decode steps (the run's own
plain decode step after the verify), the first token after the residual's last byte (in decode steps; the monolithic
full code's first token comes about one step after it), and TT1 and TT64 from the start. On a shared machine the
absolute times move with the load; compare the settings within one run.
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

LYNXKV = str(Path(sys.executable).with_name("lynxkv"))


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def measure(stats: dict) -> dict:
    step = stats["decode_step_s"]
    res = stats["residual_ready_s"]
    times = stats["commit_times_s"]
    return {
        "kept": f"{stats['accepted']}/{stats['drafted']}",
        "ready_s": res,  # the full code built (the residual's last byte, then what was left to dequantize)
        "verify_s": stats["verify_s"],
        "verify_steps": stats["verify_s"] / step if stats["verify_s"] and step else None,
        "first_after_residual_steps": (stats["first_commit_s"] - res) / step if res is not None and step else None,
        "tt1_s": times[0] if times else None,
        "tt64_s": times[63] if len(times) >= 64 else None,
        "step_s": step,
        "draft_ratio": stats["draft_step_s"] / step if stats["draft_step_s"] and step else None,
    }


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--bandwidth", default="60Mbps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verify-first", type=int, default=2)
    ap.add_argument("--settings", default="before,grouped,defaults,first",
                    help="comma-separated keys: before, grouped, defaults, first, nointerrupt, nobetween, "
                         "nolayered, layered, window0 .. window4 (the defaults with --min-window 0 .. 4)")
    a = ap.parse_args(argv)
    late = {"LYNXKV_EAGER_RESIDUAL": "0"}
    flat = ["--no-layered-verify"]  # the verify after the whole residual, as every setting but the defaults had it
    known = {"before": ("before", {"LYNXKV_GROUPED_SDPA": "0", **late}, flat),
             "grouped": ("grouped", late, flat),
             "defaults": ("grouped, eager, layered (the defaults)", {}, []),
             "first": (f"grouped, eager, --verify-first {a.verify_first}", {}, ["--verify-first", str(a.verify_first)]),
             "nointerrupt": ("grouped, eager, no interrupt", {"LYNXKV_INTERRUPT_DRAFTS": "0",
                                                              "LYNXKV_DEQUANT_BETWEEN_DRAFTS": "0"}, flat),
             "nobetween": ("grouped, eager, no dequantizing between drafts", {"LYNXKV_DEQUANT_BETWEEN_DRAFTS": "0"},
                           flat),
             "nolayered": ("grouped, eager, --no-layered-verify", {}, flat),
             "layered": ("grouped, eager, --layered-verify", {}, ["--layered-verify"]),
             **{f"window{w}": (f"the defaults, --min-window {w}", {}, ["--min-window", w]) for w in "01234"}}
    keys = [k.strip() for k in a.settings.split(",") if k.strip()]
    unknown = [k for k in keys if k not in known]
    if unknown or not keys:
        ap.error(f"--settings: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    settings = [known[k] for k in keys]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in settings}
    with tempfile.TemporaryDirectory() as d:
        cache = Path(d) / "v.lynx"
        subprocess.run([LYNXKV, "encode", "--model", "smollm2", "--tokens", str(a.tokens), "-o", str(cache)],
                       check=True, capture_output=True, env=env)
        for r in range(a.repeats):
            for name, extra_env, args in settings:
                out = subprocess.run([LYNXKV, "run", str(cache), "--bandwidth", a.bandwidth, "-n", "64",
                                      "--ignore-eos", "--json", *args], check=True, capture_output=True, text=True,
                                     env={**env, **extra_env})
                doc = json.loads(out.stdout)
                runs[name].append({**measure(doc["stats"]), "tokens": doc["token_ids"]})
                m = runs[name][-1]
                print(f"round {r + 1} {name}: verify {fmt(m['verify_s'], '.3f')} s, TT1 {fmt(m['tt1_s'])} s, "
                      f"TT64 {fmt(m['tt64_s'])} s", file=sys.stderr, flush=True)
    same = len({tuple(m["tokens"]) for ms in runs.values() for m in ms}) == 1
    print(f"SmolLM2, built-in prompt of {a.tokens} tokens, {a.bandwidth}, fp32, medians of {a.repeats} interleaved "
          f"rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| setting | drafts kept | draft / decode step | full code ready | verify | verify / decode step "
          "| first token after the residual | TT1 | TT64 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ms in runs.items():
        f = {k: _med([m[k] for m in ms]) for k in ("draft_ratio", "ready_s", "verify_s", "verify_steps",
                                                      "first_after_residual_steps", "tt1_s", "tt64_s")}
        print(f"| {name} | {', '.join(m['kept'] for m in ms)} | {fmt(f['draft_ratio'])} | {fmt(f['ready_s'])} s "
              f"| {fmt(f['verify_s'], '.3f')} s | {fmt(f['verify_steps'])} "
              f"| {fmt(f['first_after_residual_steps'])} steps | {fmt(f['tt1_s'])} s | {fmt(f['tt64_s'])} s |")
    print(f"same tokens in every run: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
