"""The plain decode step after Lynx's verify pass against the monolithic full code's step at the same cache length.

    .venv/bin/python benchmarks/bench_post_verify.py --tokens 1000 --repeats 3

Encodes the built-in prompt with the offline SmolLM2 into a temporary directory, then runs Lynx (an emulated link
whose residual takes about ``--residual-steps`` decode steps) and the monolithic full-code baseline on the same
link, interleaved, ``--repeats`` times each. For every cache length both decoded at, it takes the median step of
each method over the runs; the table gives the median over those lengths of each, and their ratio (the target:
<= 1.05). Decode steps are recorded by the runner (``RunStats.decode_steps``). On a shared machine the figures
are noisy: compare medians, and rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def steps_by_length(stats_list) -> dict[int, float]:
    """cache length -> median step seconds over the runs (only lengths every run reached)."""
    per: dict[int, list[float]] = {}
    for st in stats_list:
        for start, end, length in st.decode_steps:
            per.setdefault(int(length), []).append(end - start)
    return {n: statistics.median(v) for n, v in per.items() if len(v) == len(stats_list)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--residual-steps", type=float, default=20.0)
    ap.add_argument("--json", dest="json_out", default=None, help="Also write the figures here.")
    a = ap.parse_args(argv)

    import torch

    from lynxkv.cache import save_cache
    from lynxkv.hf import prefill
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.quant.scheme import DEFAULT
    from lynxkv.speculative import RunConfig
    from lynxkv.bench.compare import baseline_cases, run_baseline, run_lynx
    from lynxkv.speculative.model_ops import measure_tpot
    from lynxkv.bench.emulated_link import link_at
    from lynxkv.stream.progressive import open_progressive

    lm = load_model(None)
    ids = encode_prompt(lm, builtin_prompt(lm.tokenizer, a.tokens))
    kv, _ = prefill(lm.model, ids)
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "c.lynx")
        info = save_cache(path, kv, DEFAULT, prompt_token_ids=ids.tolist(), model_fingerprint=lm.fingerprint)
        tpot = measure_tpot(lm.model, kv, len(ids))
        rate = info.residual_bytes / (a.residual_steps * tpot)
        cfg = RunConfig(max_new_tokens=a.max_new_tokens)

        def open_load():
            return open_progressive(path, link=link_at(rate))

        probe = open_load()
        anchor_kv, full_kv = probe.wait_anchor(), probe.residual.result()
        probe.close()
        case = baseline_cases(anchor_kv, full_kv, info.anchor_bytes, info.residual_bytes)["monolithic-full"]
        lynx, full = [], []
        for r in range(a.repeats):
            order = ("lynx", "full") if r % 2 == 0 else ("full", "lynx")
            for m in order:
                if m == "lynx":
                    lynx.append(run_lynx(lm.model, open_load, cfg, lm.fingerprint)[1].stats)
                else:
                    full.append(run_baseline(lm.model, case, ids.tolist(), lm.fingerprint, bandwidth=rate,
                                             latency=None, config=cfg)[1].stats)
    a_steps, b_steps = steps_by_length(lynx), steps_by_length(full)
    common = sorted(set(a_steps) & set(b_steps))
    if not common:
        print("no cache length decoded by both methods", file=sys.stderr)
        return 1
    post = statistics.median(a_steps[n] for n in common)
    mono = statistics.median(b_steps[n] for n in common)
    out = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prompt_tokens": len(ids),
        "repeats": a.repeats, "tpot_probe_s": tpot, "lengths_compared": len(common),
        "post_verify_step_s": post, "monolithic_step_s": mono, "ratio": post / mono,
        "accepted_per_run": [f"{s.accepted}/{s.drafted}" for s in lynx],
    }
    print(f"{len(ids)}-token prompt, {a.repeats} interleaved runs each, {len(common)} cache lengths decoded by both")
    print(f"post-verify step {post * 1e3:.1f} ms, monolithic full-code step {mono * 1e3:.1f} ms "
          f"(medians over lengths of per-length medians): ratio {post / mono:.3f} (target <= 1.05)")
    print(f"drafts kept per Lynx run: {', '.join(out['accepted_per_run'])}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
