"""Lynx against the monolithic full code on held-out prompts, at several link rates, on the path `lynxkv run
--compare` takes (its Python calls: a step timed before the load opens, the progressive reader over an emulated
link, the engine, the monolithic baselines over the same link).

    .venv/bin/python benchmarks/bench_held_out.py --prompts 6 --rates 60Mbps --repeats 3

The prompts are the first ``--prompts`` ~``--tokens``-token pieces of the held-out corpus of ``lynxkv eval``
(``lynxkv.eval.cases.text_cases`` over ``stdlib_text()``, the Python standard library's own source, skipping any
piece that shares a 32-token run with the corpus the defaults were chosen on), decoded to text. Each is encoded
with ``lynxkv encode --model smollm2 --prompt-file`` and decoded 64 tokens (no stop token) by every method N times,
interleaved round by round (``lynxkv.bench.compare.compare_run(repeats=N)``); medians. One row per prompt and rate:

- the drafts kept (the main chain's accepted drafts plus the branch's) and what they are worth, kept × the decode
  step; the measured gain over the monolithic full code as a fraction of that worth (what the machinery keeps of
  what the anchor earns) and in units of Δ = min(t_res, 64·TPOT);
- TT1 and TT64 of Lynx, the monolithic full code and the anchor alone; Lynx / anchor-only, Lynx / full;
- TT1 against the full code's TT1 plus one decode step;
- the verify on the critical path (verify end minus the moment the whole residual was in), in decode steps
  (target <= 1.5), and whether it ran layer by layer as the residual landed;
- the post-verify decode step over the monolithic full code's step at the same cache lengths (target <= 1.05);
- the same tokens as the full code.
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

ROOT = Path(__file__).resolve().parents[1]
LYNXKV = str(Path(sys.executable).with_name("lynxkv"))


def held_out_prompts(count: int, tokens: int, out: Path) -> list[Path]:
    from lynxkv.eval.cases import choosing_runs, stdlib_text, text_cases
    from lynxkv.hf.models import load_model

    tok = load_model().tokenizer
    cases, _ = text_cases(tok, stdlib_text(), tokens, count, 0, avoid=choosing_runs(tok))
    paths = []
    for i, (ids, _) in enumerate(cases):
        p = out / f"p{i + 1}.txt"
        p.write_text(tok.decode(ids.tolist()))
        paths.append(p)
    return paths


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def steps_by_length(stats_list) -> dict[int, float]:
    per: dict[int, list[float]] = {}
    for st in stats_list:
        for start, end, length in st["decode_steps"]:
            per.setdefault(int(length), []).append(end - start)
    return {n: statistics.median(v) for n, v in per.items() if len(v) == len(stats_list)}


def row_of(doc: dict, prompt: str, rate: str) -> dict:
    cmp = doc["compare"]
    rows = {r["method"]: r for r in cmp["rows"]}
    lynx, full = cmp["stats"]["lynx"], cmp["stats"]["monolithic-full"]
    j = cmp["judge"]
    step = _med([s["decode_step_s"] for s in full])
    critical = _med([s["verify_end_s"] - s["residual_ready_s"] for s in lynx
                     if s["verify_end_s"] is not None and s["residual_ready_s"] is not None])
    a, b = steps_by_length(lynx), steps_by_length(full)
    common = sorted(set(a) & set(b))
    post = statistics.median(a[n] for n in common) / statistics.median(b[n] for n in common) if common else None
    tt1, full_tt1 = rows["lynx"]["tt1_s"], rows["monolithic-full"]["tt1_s"]
    return {
        "prompt": prompt, "rate": rate,
        # with a branch, "+1+n": the branch's root and n of its drafts kept after the main chain's
        # and "(fork at p)" for a fork whose branch was not verified (the main chain was not rejected there)
        "worth_s": (_med([s["accepted"] + (s.get("branch_accepted") or 0) for s in lynx]) or 0) * step
        if step else None,
        "kept": ", ".join(f"{s['accepted']}/{s['drafted']}" + (
            f"+1+{s['branch_accepted']}" if s.get("branch_accepted") is not None
            else f" (fork at {s['branch_at']})" if s.get("branch_at") is not None else "") for s in lynx),
        "forks": [s.get("branch_at") for s in lynx],
        # when each method's full code was in (the monolithic run's whole cache), medians: TT1 starts there
        "full_code_ready_lynx_s": _med([s["residual_ready_s"] for s in lynx]),
        "full_code_ready_full_s": _med([s["residual_ready_s"] for s in full]),
        "layered": sum(bool(s.get("verify_layered")) for s in lynx),
        "tt1_lynx_s": tt1, "tt1_full_s": full_tt1, "step_s": step,
        "tt1_met": tt1 is not None and full_tt1 is not None and step is not None and tt1 <= full_tt1 + step,
        "tt64_lynx_s": j["tt_lynx_s"], "tt64_full_s": j["tt_full_s"], "tt64_anchor_s": j["tt_anchor_only_s"],
        "delta_s": j["delta_theoretical_s"], "gain_s": j["gain_measured_s"],
        "gain_delta": j["gain_measured_s"] / j["delta_theoretical_s"] if j["delta_theoretical_s"] else None,
        "gain_of_worth": None,
        "anchor_ratio": j["ratio_to_anchor_only"],
        "vs_full": j["tt_lynx_s"] / j["tt_full_s"],
        "verify_critical_steps": critical / step if critical is not None and step else None,
        "post_verify_ratio": post,
        "same_tokens": rows["monolithic-full"]["same_tokens_as_lynx"],
    }


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--rates", default="60Mbps", help="comma-separated, e.g. 12Mbps,60Mbps,200Mbps,1Gbps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_out", default=None, help="Also write every row here.")
    a = ap.parse_args(argv)

    from lynxkv.bench.compare import compare_run
    from lynxkv.hf.models import load_model
    from lynxkv.speculative import RunConfig, Timing, run
    from lynxkv.bench.emulated_link import link_at
    from lynxkv.stream import open_progressive
    from lynxkv.stream.units import parse_bandwidth

    lm = load_model()
    cfg = RunConfig(max_new_tokens=64)  # no stop token: 64 tokens every time
    rows = []
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for i, prompt in enumerate(held_out_prompts(a.prompts, a.tokens, d), 1):
            cache = d / f"h{i}.lynx"
            subprocess.run([LYNXKV, "encode", "--model", "smollm2", "--prompt-file", str(prompt), "-o", str(cache)],
                           check=True, capture_output=True, env=env)
            timing = Timing()  # as lynxkv run: a step timed at the prompt's length before the first load opens
            with open_progressive(str(cache)) as probe:
                probe.wait_anchor(60)
                cached = len(probe.prompt_token_ids)
            timing.calibrate(lm.model, cached)
            for rate in a.rates.split(","):
                def open_load(rate=rate):
                    return open_progressive(str(cache), link=link_at(rate), room=cfg.max_new_tokens + 1)

                started = time.perf_counter()
                load = open_load()
                try:
                    first = run(lm.model, load, cfg, fingerprint=lm.fingerprint, started_at=started, timing=timing)
                    cmp = compare_run(lm.model, load, first, cfg, lm.fingerprint, bandwidth=parse_bandwidth(rate),
                                      repeats=a.repeats, open_load=open_load, timing=timing)
                finally:
                    load.close()
                rows.append(row_of({"compare": cmp}, f"p{i}", rate))
                r = rows[-1]
                r["gain_of_worth"] = r["gain_s"] / r["worth_s"] if r["worth_s"] else None
                print(f"p{i} {rate}: TT64 lynx {r['tt64_lynx_s']:.2f} s, full {r['tt64_full_s']:.2f} s, "
                      f"gain {fmt(r['gain_s'])} s of {fmt(r['worth_s'])} s worth", file=sys.stderr, flush=True)

    head = ("| prompt | rate | drafts kept | kept × step | gain | gain / worth | gain / Δ | layered "
            "| TT1 lynx / full (+1 step) | TT64 lynx | full | anchor | lynx / anchor | lynx / full "
            "| verify on the critical path | post-verify step | same tokens |")
    print(f"{a.prompts} held-out ~{a.tokens}-token prompts, SmolLM2, medians of {a.repeats} interleaved runs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['prompt']} | {r['rate']} | {r['kept']} | {fmt(r['worth_s'])} s | {fmt(r['gain_s'])} s "
              f"| {fmt(r['gain_of_worth'])} | {fmt(r['gain_delta'])} Δ | {r['layered']}/{a.repeats} "
              f"| {fmt(r['tt1_lynx_s'])} / {fmt(r['tt1_full_s'])} ({'met' if r['tt1_met'] else 'no'}) "
              f"| {fmt(r['tt64_lynx_s'])} | {fmt(r['tt64_full_s'])} | {fmt(r['tt64_anchor_s'])} "
              f"| {fmt(r['anchor_ratio'], '.3f')} "
              f"| {fmt(r['vs_full'], '.3f')} | {fmt(r['verify_critical_steps'])} steps "
              f"| {fmt(r['post_verify_ratio'], '.3f')} | {'yes' if r['same_tokens'] else 'NO'} |")
    for rate in a.rates.split(","):
        mine = [r for r in rows if r["rate"] == rate]
        ratios = sorted(r["vs_full"] for r in mine)
        print(f"{rate}: TT64 lynx / full {fmt(statistics.median(ratios), '.3f')} (min {fmt(ratios[0], '.3f')}, max "
              f"{fmt(ratios[-1], '.3f')}) over {len(mine)} prompts; TT1 within a step of the full code's on "
              f"{sum(r['tt1_met'] for r in mine)} of {len(mine)}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
