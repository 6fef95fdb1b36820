"""Drafting where it pays: Lynx always drafting, Lynx with the default rule (wait when the residual is due within
``min_window_steps`` decode steps), and the monolithic full code, on a short prompt over fast links.

    .venv/bin/python benchmarks/bench_draft_pays.py --tokens 1000 --rates 1Gbps,200Mbps --repeats 3

Encodes the built-in prompt with the offline SmolLM2 into a temporary directory; for each rate runs the three
methods ``--repeats`` times, interleaved (the order rotates by round), and prints TT-n medians, each Lynx variant's
ratio to the monolithic full code (the target: <= 1.02), how many drafts each made and whether the tokens were the
full code's. The step time the rule uses comes from the model's last run in the process, as in ``lynxkv run
--compare`` after its first round. On a shared machine the figures are noisy: compare medians, and rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rates", default="1Gbps,200Mbps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", dest="json_out", default=None, help="Also write the figures here.")
    a = ap.parse_args(argv)

    from lynxkv.cache import save_cache
    from lynxkv.hf import prefill
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.quant.scheme import DEFAULT
    from lynxkv.speculative import RunConfig
    from lynxkv.bench.compare import baseline_cases, run_baseline, run_lynx
    from lynxkv.bench.emulated_link import link_at
    from lynxkv.stream.progressive import open_progressive
    from lynxkv.stream.units import parse_bandwidth

    lm = load_model(None)
    ids = encode_prompt(lm, builtin_prompt(lm.tokenizer, a.tokens))
    kv, _ = prefill(lm.model, ids)
    n = a.max_new_tokens
    cfg = RunConfig(max_new_tokens=n)
    variants = {"lynx (always drafts)": replace(cfg, min_window_steps=0), "lynx (drafts where it pays)": cfg}
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prompt_tokens": len(ids),
              "repeats": a.repeats, "rates": {}}
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "c.lynx")
        info = save_cache(path, kv, DEFAULT, prompt_token_ids=ids.tolist(), model_fingerprint=lm.fingerprint)
        probe = open_progressive(path)
        anchor_kv, full_kv = probe.wait_anchor(), probe.residual.result()
        probe.close()
        case = baseline_cases(anchor_kv, full_kv, info.anchor_bytes, info.residual_bytes)["monolithic-full"]
        run_baseline(lm.model, case, ids.tolist(), lm.fingerprint, bandwidth=None, latency=None,
                     config=cfg)  # warm-up; also gives the rule its step time
        for rate_text in a.rates.split(","):
            rate = parse_bandwidth(rate_text)
            methods = [*variants, "monolithic-full"]
            got: dict[str, list] = {m: [] for m in methods}
            for r in range(a.repeats):
                for m in methods[r % 3:] + methods[: r % 3]:
                    if m == "monolithic-full":
                        res = run_baseline(lm.model, case, ids.tolist(), lm.fingerprint, bandwidth=rate,
                                           latency=None, config=cfg)[1]
                    else:
                        res = run_lynx(lm.model, lambda: open_progressive(path, link=link_at(rate)), variants[m],
                                       lm.fingerprint)[1]
                    got[m].append(res)
            ref = got["monolithic-full"][0].token_ids
            full_tt = statistics.median(x.stats.tt(n) for x in got["monolithic-full"])
            rows = {}
            print(f"\n{len(ids)}-token prompt at {rate_text} (residual {info.residual_bytes / 1e6:.1f} MB), "
                  f"medians of {a.repeats} interleaved runs:")
            for m in methods:
                tt = statistics.median(x.stats.tt(n) for x in got[m])
                rows[m] = {"tt_s": tt, "ratio_to_full": tt / full_tt, "tt_per_run_s": [x.stats.tt(n) for x in got[m]],
                           "drafted": [x.stats.drafted for x in got[m]], "accepted": [x.stats.accepted for x in got[m]],
                           "same_tokens": all(x.token_ids == ref for x in got[m])}
                print(f"  {m:28s} TT{n} {tt:6.3f} s  {tt / full_tt:5.3f}x full  per run "
                      f"{' '.join(f'{t:.3f}' for t in rows[m]['tt_per_run_s'])}  drafts kept "
                      f"{' '.join(f'{x.stats.accepted}/{x.stats.drafted}' for x in got[m])}  same tokens: "
                      f"{'yes' if rows[m]['same_tokens'] else 'NO'}")
            report["rates"][rate_text] = rows
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
