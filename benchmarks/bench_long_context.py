"""A real model at long contexts through the CLI: held-out prompts of 8K, 16K and 32K tokens on Gemma 3 270M, each
through `lynxkv encode --model`, `inspect`, `verify` and `run --compare` over an emulated link, every command under
/usr/bin/time (wall seconds, peak RSS).

    .venv/bin/python benchmarks/bench_long_context.py --lengths 8K,16K,32K --prompts 1,2,1 --rate 60Mbps

The prompts are the first pieces of ~N tokens of the held-out corpus of `lynxkv eval` (the Python standard library's
own source, `lynxkv.eval.cases.text_cases`, skipping any piece that shares a 32-token run with the corpus the
defaults were chosen on), decoded to text with the model's tokenizer. `encode` prefills the prompt (the time is
mostly that) and chooses the anchor (`--scheme auto`); `run --compare` decodes 64 tokens (no stop token) with Lynx
and the monolithic baselines over the same link, once each. Per prompt: the anchor chosen and each candidate's KL,
the drafts made and kept on the anchor (the acceptance), TT64 of Lynx and of the monolithic full code, the gain,
whether Lynx's tokens equal the full code's, and each command's wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lynxkv.bench.timed import run_timed

LYNXKV = str(Path(sys.executable).with_name("lynxkv"))


def parse_length(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1000) if text.endswith("K") else int(text)


def held_out_prompts(model: str, tokens: int, count: int, out: Path, eval_windows: int = 1) -> list[Path]:
    """The first ``count`` held-out prompts of ~``tokens`` tokens, spaced as ``lynxkv eval --windows
    eval_windows`` spaces its prompts (each followed by the text its windows and perplexity read), so they are
    that evaluation's prompts."""
    from lynxkv.eval.cases import choosing_runs, stdlib_text, text_cases
    from lynxkv.hf.models import load_model

    tok = load_model(model).tokenizer
    continuation = max(64, (eval_windows - 1) * 64)  # as lynxkv.eval.suite: max(--ppl-tokens, (N - 1) W)
    cases, _ = text_cases(tok, stdlib_text(), tokens, count, continuation, avoid=choosing_runs(tok))
    paths = []
    for i, (ids, _) in enumerate(cases):
        p = out / f"p{tokens}-{i + 1}.txt"
        p.write_text(tok.decode(ids.tolist(), skip_special_tokens=True))
        paths.append(p)
    return paths


def timed(*argv) -> tuple[str, float, float]:
    """The CLI under GNU time: (stdout, wall seconds, peak RSS in MiB)."""
    t = run_timed([LYNXKV, *argv])
    return t.stdout, t.wall_s, t.peak_mib


def one_prompt(model: str, prompt: Path, rate: str, work: Path) -> dict:
    cache = work / "c.lynx"
    for stale in (cache, cache.with_suffix(".lynxr")):
        stale.unlink(missing_ok=True)
    out, enc_s, enc_rss = timed("encode", "--model", model, "--prompt-file", prompt, "-o", cache, "--json")
    encoded = json.loads(out)
    described, _, _ = timed("inspect", cache, "--json")
    _, ver_s, ver_rss = timed("verify", cache)
    out, run_s, run_rss = timed("run", cache, "--model", model, "--bandwidth", rate, "--compare", "-n", 64,
                                "--ignore-eos", "--json")
    report = json.loads(out)
    rows = {r["method"]: r for r in report["compare"]["rows"]}
    stats, judge = report["stats"], report["compare"]["judge"]
    full = rows["monolithic-full"]
    return {
        "prompt": prompt.name, "tokens": json.loads(described)["tokens"],
        "chosen": encoded["choice"]["chosen"],
        "kl": {c["name"]: c["kl"] for c in encoded["choice"]["candidates"]},
        "drafted": stats["drafted"], "kept": stats["accepted"],
        "tt64_lynx_s": judge["tt_lynx_s"], "tt64_full_s": judge["tt_full_s"], "gain_s": judge["gain_measured_s"],
        "same_tokens_as_full": full["same_tokens_as_lynx"],
        "encode_s": enc_s, "encode_rss_mib": enc_rss, "verify_s": ver_s, "verify_rss_mib": ver_rss,
        "run_s": run_s, "run_rss_mib": run_rss,
        "anchor_bytes": encoded["anchor_bytes"], "residual_bytes": encoded["residual_bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", default="8K,16K,32K", help="prompt lengths in tokens (K = 1000)")
    ap.add_argument("--prompts", default="1,2,1", help="prompts per length, in the order of --lengths")
    ap.add_argument("--rate", default="60Mbps")
    ap.add_argument("--eval-windows", type=int, default=1, help="space the prompts as `lynxkv eval --windows N "
                    "--tokens T` (64-token windows, 64 perplexity tokens) does, so that they are its prompts")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    counts = [int(x) for x in args.prompts.split(",")]
    if len(counts) != len(lengths):
        sys.exit("--prompts: one count per length")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for tokens, count in zip(lengths, counts):
            for prompt in held_out_prompts(args.model, tokens, count, work, args.eval_windows):
                row = one_prompt(args.model, prompt, args.rate, work)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{args.model}, held-out prompts, {args.rate}, 64 tokens, one run each\n")
    print("| tokens | chosen (KL default / plain-keys) | kept / drafted | TT64 lynx / full | gain | same tokens | "
          "encode (s, MiB) | verify (s, MiB) | run --compare (s, MiB) |")
    print("|---:|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        kl = " / ".join(f"{r['kl'][k]:.2e}" for k in ("default", "plain-keys"))
        print(f"| {r['tokens']:,} | {r['chosen']} ({kl}) | {r['kept']} / {r['drafted']} | "
              f"{r['tt64_lynx_s']:.2f} / {r['tt64_full_s']:.2f} s | {r['gain_s']:+.2f} s | {r['same_tokens_as_full']} | "
              f"{r['encode_s']:.0f}, {r['encode_rss_mib']:,.0f} | {r['verify_s']:.1f}, {r['verify_rss_mib']:,.0f} | "
              f"{r['run_s']:.0f}, {r['run_rss_mib']:,.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
