"""Many requests at once: ``lynxkv run A B ... H`` (one batch, one link) against the same requests one by one.

Eight SmolLM2 caches of 500-2,000 tokens (the built-in prompt from eight different starts, encoded once into
``--dir``), all arriving together over one emulated link (default 60 Mbit/s), 64 tokens each, greedy. Every
repeat runs, interleaved, through the CLI in this process (``lynxkv.cli.main``, ``--json``):

    lynx       the batch (one cache at a time on the link, smallest first) with ``--compare``: the same batch on
               the monolithic full code over the same link
    batch      the batch alone (its wall time is the batch's throughput)
    one-by-one each cache alone on its own link, one after another (batch 1; not with --no-batch1)
    decode-8 / decode-1   with --decode-only, the same without a link (caches on local disk): decode alone

and prints the medians over the repeats: aggregate tokens/s (batch 8 against batch 1, beside the bound the link
alone sets on that ratio), per-request TT64 of Lynx against the batched monolithic full code (the gain in units of
Δ = min(t_res, 64·TPOT)), and whether every request's tokens equal its batch-1 run's.

    python benchmarks/bench_batch.py --repeats 3 [--dir /tmp/bench-batch] [--bandwidth 60Mbps] [--json out.json]
                                     [--no-batch1]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time

LENGTHS = (500, 700, 900, 1100, 1300, 1500, 1750, 2000)
# The order the requests are given in (arrival order): not by size, so that sending the smallest first differs from it.
ORDER = (7, 0, 5, 2, 6, 1, 4, 3)


def encode(folder: str) -> list[str]:
    from lynxkv.hf.models import load_model
    from lynxkv.hf.encoding import encode_model
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.quant.scheme import get_scheme

    os.makedirs(folder, exist_ok=True)
    tok = load_model().tokenizer
    paths = []
    for i, n in enumerate(LENGTHS):
        path = os.path.join(folder, f"c{i}.lynx")
        if not os.path.exists(path):
            encode_model(None, path, get_scheme("default"), prompt=builtin_prompt(tok, n, start=37 * i))
        paths.append(path)
    return paths


def cli(*args: str) -> tuple[dict, float]:
    """``lynxkv run ARGS --json`` in this process: (its JSON, seconds)."""
    from lynxkv.cli import main

    buf = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(["run", *args, "--json"])
    wall = time.perf_counter() - t
    if code != 0:
        raise SystemExit(f"lynxkv run {' '.join(args)} exited {code}")
    return json.loads(buf.getvalue()), wall


def link_bound(requests: list[dict], singles: list[dict], walls: list[float], link: list[str]) -> dict | None:
    """An estimate of the most that batch 8 over one link can gain on the same requests one by one: a batch cannot
    end before the link has carried every cache (their bytes over the rate) and then decoded the last one to land,
    taken to need at least the shortest time any single run spent past its own bytes. ``{"link_s", "ratio"}``, or
    None without the one-by-one runs or a link."""
    from lynxkv.stream.units import parse_bandwidth

    rate = parse_bandwidth(link[link.index("--bandwidth") + 1]) if "--bandwidth" in link else None
    if not singles or not rate:
        return None

    def sent(stats: dict) -> int:
        return stats["load"]["anchor_bytes"] + stats["load"]["residual_bytes"]

    link_s = sum(sent(r["stats"]) for r in requests) / rate
    after = min(w - sent(d["stats"]) / rate for d, w in zip(singles, walls))
    return {"link_s": link_s, "ratio": sum(walls) / (link_s + after)}


def _delta(st: dict) -> float | None:
    """Δ = min(t_res, 64·TPOT) of one request's stats."""
    if st["residual_after_anchor_s"] is None or st["tpot_s"] is None:
        return None
    return min(st["residual_after_anchor_s"], 64 * st["tpot_s"])


def one_round(paths: list[str], link: list[str], n: int, decode_only: bool, batch1: bool = True) -> dict:
    common = ["-n", str(n), "--ignore-eos"]
    out = {}
    lynx, _ = cli(*paths, *common, *link, "--compare")
    batch, out["wall_batch8"] = cli(*paths, *common, *link)
    singles, walls = [], []
    for p in paths if batch1 else ():
        doc, wall = cli(p, *common, *link)
        singles.append(doc)
        walls.append(wall)
    tokens = sum(len(r["token_ids"]) for r in lynx["requests"])
    out["tps_batch8"] = tokens / out["wall_batch8"]
    out["tps_batch1"] = tokens / sum(walls) if walls else None
    out["link_bound"] = link_bound(lynx["requests"], singles, walls, link)
    out["tps_decode8"] = out["tps_decode1"] = None
    if decode_only:
        out["wall_decode8"] = cli(*paths, *common)[1]
        out["tps_decode8"] = tokens / out["wall_decode8"]
        out["tps_decode1"] = tokens / sum(cli(p, *common)[1] for p in paths)
    rows = []
    for r, s in zip(lynx["requests"], singles or [None] * len(paths)):
        st = r["stats"]
        rows.append({"name": r["name"], "prompt": st["prompt_tokens"], "tt1": st["tt1_s"], "tt64": st["tt64_s"],
                     "tt64_mono": r["compare"]["monolithic_full"]["tt64_s"], "gain": r["compare"]["gain_tt64_s"],
                     "delta": _delta(st), "kept": f"{st['accepted']}/{st['drafted']}",
                     "tt64_batch1": s["stats"]["tt64_s"] if s else None,
                     "same_as_mono": r["compare"]["monolithic_full"]["same_tokens_as_lynx"],
                     "same_as_batch1": r["token_ids"] == s["token_ids"] if s else None})
    out["rows"] = rows
    out["tt64_mean_lynx"] = lynx["aggregate"]["tt64_mean_s"]
    out["tt64_mean_mono"] = lynx["aggregate"]["monolithic_full"]["tt64_mean_s"]
    out["acceptance"] = lynx["aggregate"]["acceptance_rate"]
    out["verify_per_token"] = lynx["aggregate"]["verify_s_per_token"]
    out["same_batch_tokens"] = [r["token_ids"] for r in batch["requests"]] == [r["token_ids"] for r in lynx["requests"]]
    return out


def step_times(repeats: int, steps: int = 4) -> None:
    """Decode throughput alone, without links or speculation: per repeat (interleaved) one decode step of each of
    the eight caches' lengths at batch 1, then one packed step of all eight; and how the packed step splits
    between attention (per request, over its own cache) and the rest (torch.profiler); then the step's attention
    alone against a plain sum over the same keys and values (the memory's rate for one pass over them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lynxkv.hf.models import load_model
    from lynxkv.speculative.model_ops import forward_tokens, start_cache
    from lynxkv.speculative.packed import forward_packed

    model = load_model().model
    layers, heads, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    g = torch.Generator().manual_seed(0)
    kvs = [[(torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g)) for _ in range(layers)]
           for n in LENGTHS]  # the values do not change the time of a step
    single = [start_cache(model, kv, n) for kv, n in zip(kvs, LENGTHS)]
    packed = [start_cache(model, kv, n) for kv, n in zip(kvs, LENGTHS)]
    for c in single:
        forward_tokens(model, c, [1])
    forward_packed(model, packed, [[1]] * len(packed))
    one, eight = [], []
    for _ in range(repeats):
        for _ in range(steps):
            t = time.perf_counter()
            for c in single:
                forward_tokens(model, c, [1])
            one.append(time.perf_counter() - t)
            t = time.perf_counter()
            forward_packed(model, packed, [[1]] * len(packed))
            eight.append(time.perf_counter() - t)
    sizes = {}
    for k in (1, 2, 4):  # one packed step of the first k caches (then all eight, above)
        caches = [start_cache(model, kv, n) for kv, n in zip(kvs[:k], LENGTHS[:k])]
        forward_packed(model, caches, [[1]] * k)
        times = []
        for _ in range(repeats * steps):
            t = time.perf_counter()
            forward_packed(model, caches, [[1]] * k)
            times.append(time.perf_counter() - t)
        sizes[k] = statistics.median(times)
    m1, m8 = statistics.median(one), statistics.median(eight)
    sizes[len(LENGTHS)] = m8
    print("packed step by requests in it: " + ", ".join(f"{k}: {1e3 * t:.0f} ms" for k, t in sizes.items()))
    print(f"decode step, {len(LENGTHS)} requests of {LENGTHS[0]}-{LENGTHS[-1]} tokens: one by one {m1:.3f} s, packed "
          f"{m8:.3f} s: {m1 / m8:.2f}x the tokens per second (medians of {len(one)} interleaved steps, "
          f"{torch.get_num_threads()} threads)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_packed(model, packed, [[1]] * len(packed))
    total = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    attn = sum(v for k, v in total.items() if "scaled_dot_product" in k or "flash_attention" in k)
    dense = sum(v for k, v in total.items() if k in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul"))
    whole = sum(total.values())
    print(f"packed step by operator (self CPU time): attention {attn / whole:.0%}, matrix products {dense / whole:.0%}, "
          f"the rest {(whole - attn - dense) / whole:.0%}")
    # The attention of one packed step alone (each request's keys and values as the step reads them: the same SDPA
    # call per request and layer), against a plain reduction over the same tensors: how near the attention comes to
    # what this machine's memory gives one pass over the caches.
    kv_views = [[(layer.keys, layer.values) for layer in c.layers] for c in packed]
    q = torch.randn(1, model.config.num_attention_heads, 1, dim)
    nbytes = sum(t.numel() * t.element_size() for kv in kv_views for pair in kv for t in pair)

    def attention_pass():
        for kv in kv_views:
            for k, v in kv:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def reduction_pass():
        for kv in kv_views:
            for k, v in kv:
                k.sum(), v.sum()

    passes = {"attention": [], "reduction": []}
    for _ in range(repeats * steps):  # interleaved
        for name, fn in (("attention", attention_pass), ("reduction", reduction_pass)):
            t = time.perf_counter()
            fn()
            passes[name].append(time.perf_counter() - t)
    a_s, r_s = (statistics.median(passes[k]) for k in ("attention", "reduction"))
    print(f"attention of one packed step alone: {1e3 * a_s:.0f} ms for {nbytes / 1e6:.0f} MB of keys and values "
          f"({nbytes / a_s / 1e9:.1f} GB/s); a plain sum over the same tensors {1e3 * r_s:.0f} ms "
          f"({nbytes / r_s / 1e9:.1f} GB/s)")


def report(rounds: list[dict], names: int, a) -> None:
    """The medians over the rounds: per-request TT64 against the batched monolithic full code, then the means and
    the throughput ratios."""
    med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None  # noqa: E731
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    yes = lambda xs: "-" if any(x is None for x in xs) else ("yes" if all(xs) else "NO")  # noqa: E731
    print(f"8 SmolLM2 requests of {LENGTHS[0]}-{LENGTHS[-1]} tokens, {a.n} tokens each, one {a.bandwidth} link "
          f"(one cache at a time, smallest first); medians of {a.repeats} interleaved rounds\n")
    print("| request | prompt | TT1 | TT64 batch 8 | TT64 monolithic batch 8 | gain | Δ | gain / Δ | drafts kept "
          "| TT64 batch 1 | = monolithic | = batch 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|")
    ratios = []
    for i in range(names):
        rs = [r["rows"][i] for r in rounds]
        g, d = med([r["gain"] for r in rs]), med([r["delta"] for r in rs])
        ratios.append(g / d if g is not None and d else None)
        print(f"| {rs[0]['name']} | {rs[0]['prompt']} | {f(med([r['tt1'] for r in rs]))} | "
              f"{f(med([r['tt64'] for r in rs]))} | {f(med([r['tt64_mono'] for r in rs]))} | {f(g)} | {f(d)} | "
              f"{f(ratios[-1])} | {', '.join(r['kept'] for r in rs)} | {f(med([r['tt64_batch1'] for r in rs]))} | "
              f"{yes([r['same_as_mono'] for r in rs])} | {yes([r['same_as_batch1'] for r in rs])} |")
    print()
    # each round's ratios first (its runs were interleaved, minutes apart at most), then their median
    per = lambda x, y: med([r[x] / r[y] for r in rounds if r[x] and r[y]])  # noqa: E731
    print(f"mean TT64, medians of the rounds: lynx {f(med([r['tt64_mean_lynx'] for r in rounds]))} s, monolithic "
          f"{f(med([r['tt64_mean_mono'] for r in rounds]))} s; per round, lynx / monolithic "
          f"{f(per('tt64_mean_lynx', 'tt64_mean_mono'))}")
    print(f"median per-request gain over the batched monolithic full code: "
          f"{f(med([r for r in ratios if r is not None]))} Δ "
          f"(the batch alone gave the same tokens: {all(r['same_batch_tokens'] for r in rounds)})")
    t8, t1 = med([r["tps_batch8"] for r in rounds]), med([r["tps_batch1"] for r in rounds])
    d8, d1 = med([r["tps_decode8"] for r in rounds]), med([r["tps_decode1"] for r in rounds])
    if t1 is not None:
        print(f"aggregate tokens/s over the link: batch 8 {t8:.1f}, one by one {t1:.1f}: {t8 / t1:.2f}x "
              f"(per round {f(per('tps_batch8', 'tps_batch1'))}x)")
        bounds = [r["link_bound"] for r in rounds if r.get("link_bound")]
        if bounds:
            print(f"  by this estimate the link alone bounds that at {med([b['ratio'] for b in bounds]):.2f}x: it "
                  f"carries the eight caches in {med([b['link_s'] for b in bounds]):.1f} s, and the batch ends at "
                  "least one request's own decode after that")
    if d8 is not None:
        print(f"aggregate tokens/s without a link (decode): batch 8 {d8:.1f}, one by one {d1:.1f}: {d8 / d1:.2f}x")
    print(f"acceptance {med([r['acceptance'] for r in rounds]):.2f}; verify per accepted token "
          f"{1e3 * med([r['verify_per_token'] for r in rounds]):.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/lynxkv-bench-batch")
    ap.add_argument("--bandwidth", default="60Mbps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--steps-only", action="store_true", help="only the decode step at batch 1 against batch 8")
    ap.add_argument("--no-batch1", action="store_true", help="skip the one-by-one runs (no batch-1 TT64, no "
                    "throughput ratio): the TT64 comparisons only, in about half the time")
    ap.add_argument("--decode-only", action="store_true", help="also run the batch and the one-by-one runs without "
                    "a link (decode throughput alone)")
    a = ap.parse_args()
    if a.steps_only:
        step_times(a.repeats)
        return
    paths = [encode(a.dir)[i] for i in ORDER]
    rounds = []
    for k in range(a.repeats):
        rounds.append(one_round(paths, ["--bandwidth", a.bandwidth], a.n, a.decode_only, not a.no_batch1))
        print(f"round {k + 1} of {a.repeats} done", file=sys.stderr, flush=True)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(rounds, f, indent=1)
    report(rounds, len(paths), a)


if __name__ == "__main__":
    main()
