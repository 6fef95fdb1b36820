"""`lynxkv run` with and without `--branch-margin X`, interleaved, on the choosing corpus.

    .venv/bin/python benchmarks/bench_branch.py --margin 0.2 --starts 0,411,977,1503 --repeats 2

Choosing corpus only (never the held-out prompts of bench_held_out.py): the built-in prompt at each start
(``lynxkv.hf.prompts.builtin_prompt(tok, TOKENS, start=S)``), encoded with ``lynxkv encode --model smollm2
--prompt-file``, then ``lynxkv run CACHE --bandwidth R -n 64 --ignore-eos --json`` without and with the option,
alternating, ``--repeats`` rounds. One row per prompt and setting: drafts kept per run (with the branch:
"main/drafted+1+n", the root and n branch drafts kept after the main chain's), the fork's position, TT1 and TT64
(medians), and whether every run gave the same tokens. Then the cost of a draft step that runs both chains: its
median over the median one-chain draft step of the same runs (the first draft forward, on a fresh cache, left out),
per setting (``--copy`` adds the branch whose fork copies the draft cache, ``LYNXKV_BRANCH_SHARED_PREFIX=0``).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margin", type=float, required=True, help="the --branch-margin to compare with none")
    ap.add_argument("--starts", default="0,411,977,1503")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--rate", default="60Mbps")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copy", action="store_true", help="Also run the branch with LYNXKV_BRANCH_SHARED_PREFIX=0 "
                    "(the fork copies the draft cache instead of reading its prefix in place).")
    ap.add_argument("--json", dest="json_out", default=None, help="Also write every run's stats here.")
    ap.add_argument("--dir", default=None, help="Keep the caches here (reused when present) instead of a temporary "
                    "directory.")
    a = ap.parse_args(argv)

    from lynxkv.hf.models import load_model
    from lynxkv.hf.prompts import builtin_prompt

    tok = load_model().tokenizer
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    on = ["--branch-margin", str(a.margin)]
    settings = {"off": ([], {}), f"--branch-margin {a.margin:g}": (on, {})}
    if a.copy:
        settings[f"--branch-margin {a.margin:g}, prefix copied"] = (on, {"LYNXKV_BRANCH_SHARED_PREFIX": "0"})
    runs: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or tmp
        caches = {}
        for s in (int(x) for x in a.starts.split(",")):
            prompt, cache = Path(d) / f"p{s}-{a.tokens}.txt", Path(d) / f"c{s}-{a.tokens}.lynx"
            caches[s] = cache
            if cache.exists():
                continue
            prompt.write_text(builtin_prompt(tok, a.tokens, start=s))
            subprocess.run([LYNXKV, "encode", "--model", "smollm2", "--prompt-file", str(prompt), "-o", str(cache)],
                           check=True, capture_output=True, env=env)
        for r in range(a.repeats):
            for s, cache in caches.items():
                for name, (extra, more) in (settings.items() if r % 2 == 0 else reversed(settings.items())):
                    out = subprocess.run([LYNXKV, "run", str(cache), "--bandwidth", a.rate, "-n", "64", "--ignore-eos",
                                          "--json", *extra], check=True, capture_output=True, text=True,
                                         env={**env, **more})
                    doc = json.loads(out.stdout)
                    runs.setdefault((s, name), []).append({"token_ids": doc["token_ids"], "stats": doc["stats"]})
                    st = doc["stats"]
                    print(f"start {s} {name}: {st['accepted']}/{st['drafted']} branch {st['branch_accepted']} "
                          f"TT64 {st['tt64_s']:.2f} s", file=sys.stderr, flush=True)

    print(f"choosing corpus: built-in prompt, {a.tokens} tokens, {a.rate}, SmolLM2 fp32, medians of {a.repeats} "
          f"interleaved runs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| start | setting | drafts kept | fork at | TT1 | TT64 | same tokens (all runs of the start) |")
    print("|---:|---|---|---|---:|---:|---|")
    one, two = [], {}
    for (s, name), rs in runs.items():
        kept = ", ".join(f"{r['stats']['accepted']}/{r['stats']['drafted']}" + (
            "" if r["stats"]["branch_accepted"] is None else f"+1+{r['stats']['branch_accepted']}") for r in rs)
        forks = ", ".join("-" if r["stats"]["branch_at"] is None else str(r["stats"]["branch_at"]) for r in rs)
        same = len({tuple(r["token_ids"]) for k, v in runs.items() if k[0] == s for r in v}) == 1
        tt = lambda key: statistics.median(r["stats"][key] for r in rs)  # noqa: E731
        print(f"| {s} | {name} | {kept} | {forks} | {tt('tt1_s'):.2f} | {tt('tt64_s'):.2f} | {'yes' if same else 'NO'} |")
        for r in rs:
            st = r["stats"]
            both = {tuple(x) for x in st["branch_draft_steps"]}
            steps = [x for x in st["draft_steps"][1:]]
            one += [x[1] - x[0] for x in steps if tuple(x) not in both]
            two.setdefault(name, []).extend(x[1] - x[0] for x in steps if tuple(x) in both)
    if one:
        m1 = statistics.median(one)
        print(f"\ndraft step: one chain {m1 * 1e3:.1f} ms (n={len(one)})")
        for name, times in two.items():
            if times:
                m2 = statistics.median(times)
                print(f"two chains, {name}: {m2 * 1e3:.1f} ms (n={len(times)}): {m2 / m1:.2f}x")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({f"{s} {n}": v for (s, n), v in runs.items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
