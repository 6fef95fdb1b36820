"""Where the anchor's greedy drafts leave the full code's, and what a branch at a low-margin position would keep.

    .venv/bin/python benchmarks/diag_branch.py --starts 0,411,977,1503 --window 45

Choosing corpus only: the built-in prompt (``lynxkv.hf.prompts.builtin_prompt(tok, TOKENS, start=S)``) at each
start, encoded with the default scheme, SmolLM2 in fp32. For each prompt, three greedy chains of ``--positions``
tokens from the same start as ``lynxkv run`` (the cache keeps the prompt minus its last token, which is fed):

- the full code's greedy tokens F (the output every run must equal);
- the anchor teacher-forced on F: at each position its top-1 / top-2 logits, and the rank of F's token there;
- the anchor running free (what ``lynxkv run``'s main draft chain is): its tokens and top-1 − top-2 margins.

The first disagreement d is where the free chain first differs from F (the two agree on every logit up to d). A
branch policy forks at a position p of the free chain (within the window of ``--window`` drafts) whose margin is
below X, the branch's root being the anchor's runner-up there:

- ``first``: the first position below X (what the runner does, with X = ``lynxkv.speculative.config.BRANCH_MARGIN``);
- ``lowest``: and re-forked whenever a later position's margin is lower than the current fork's.

A fork is *true* when p = d and F's token at d is the runner-up: the verify rejects the main chain at d and the
branch's drafts are verified next. The branch is the anchor run free after F's prefix, so it keeps as many drafts
as the teacher-forced anchor agrees with F after d. Drafts kept: the main chain's accepted drafts, and with a true
fork also the branch's accepted drafts (its root is not counted: without a branch the verify gives that token too,
as its correction). A fork makes every later draft step a two-chain step; the ones that cost drafts are those
while the main chain is still right (p < i < d, or to the window's end when nothing disagrees): "costly
two-chain steps" below. Those after d only slow drafts that are rejected anyway. The window is counted in drafts,
not in time (the two-chain steps' own cost is in the end-to-end runs of bench_held_out.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch


def chains(model, tok, start: int, tokens: int, positions: int, directory: str) -> dict:
    """F, the anchor teacher-forced on F (margin, rank of F's token, runner-up) and the anchor run free."""
    from lynxkv.cache import open_cache
    from lynxkv.hf.encoding import encode_model
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.quant.scheme import get_scheme
    from lynxkv.speculative.model_ops import first_step, forward_tokens, start_cache

    path = os.path.join(directory, f"c{start}.lynx")
    encode_model(None, path, get_scheme("default"), prompt=builtin_prompt(tok, tokens, start=start))
    with open_cache(path) as c:
        ids = [int(t) for t in c.load_encoded(anchor_only=True).prompt_token_ids]
        anchor_kv, full_kv = c.load_kv(anchor_only=True), c.load_kv()
    keep, feed = first_step(ids, None)
    full, forced, free = (start_cache(model, kv, keep) for kv in (full_kv, anchor_kv, anchor_kv))
    f_tokens, f_margin, rank, runner_up, a_tokens, a_margin = [], [], [], [], [], []
    pend_full, pend_free = feed, feed
    for _ in range(positions):
        lf = forward_tokens(model, full, pend_full)[-1]  # [V]
        la = forward_tokens(model, forced, pend_full)[-1]
        t = int(lf.argmax())
        top = la.topk(2)
        f_tokens.append(t)
        f_margin.append(float(lf.topk(2).values.diff().neg()))
        rank.append(int((la > la[t]).sum()))
        runner_up.append(int(top.indices[1]))
        lr = forward_tokens(model, free, pend_free)[-1]
        top = lr.topk(2)
        a_tokens.append(int(top.indices[0]))
        a_margin.append(float(top.values[0] - top.values[1]))
        pend_full, pend_free = [t], [a_tokens[-1]]
    return dict(start=start, full=f_tokens, full_margin=f_margin, rank=rank, runner_up=runner_up,
                anchor=a_tokens, anchor_margin=a_margin)


def first_disagreement(c: dict) -> int:
    return next((i for i, (a, f) in enumerate(zip(c["anchor"], c["full"])) if a != f), len(c["full"]))


def simulate(c: dict, x: float, window: int, policy: str) -> dict:
    """One prompt under a fork policy: the fork (position or None), how many forks were made, whether the last
    is true, the drafts kept without and with the branch, and how many draft steps ran two sequences."""
    d = first_disagreement(c)
    fork, forks = None, 0
    for i in range(min(window, len(c["anchor"]))):
        m = c["anchor_margin"][i]
        if m < x and (fork is None or (policy == "lowest" and m < c["anchor_margin"][fork])):
            fork, forks = i, forks + 1
        if fork is not None and policy == "first":
            break
    kept = min(d, window)
    true = fork is not None and fork == d < window and c["rank"][d] == 1
    branch_kept = 0
    if true:
        nxt = next((i for i in range(d + 1, len(c["full"])) if c["rank"][i] != 0), len(c["full"]))
        branch_kept = min(nxt - d - 1, window - d - 1)  # the branch's accepted drafts
    return dict(d=d, fork=fork, forks=forks, true=true, kept=kept, kept_with=kept + branch_kept,
                costly=0 if fork is None else max(0, min(d, window) - fork - 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", default="0,411,977,1503")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--window", type=int, default=45, help="drafts a window holds (45: 3K tokens at 60 Mbit/s)")
    ap.add_argument("--margins", default="0.02,0.05,0.1,0.15,0.2,0.3,0.5,1.0")
    ap.add_argument("--json", dest="json_out", default=None, help="Also write the chains here.")
    ap.add_argument("--chains", default=None, help="Comma-separated JSON files of an earlier --json: simulate on "
                    "those chains (the starts they hold) instead of computing them.")
    a = ap.parse_args(argv)

    if a.chains:
        all_chains = [c for f in a.chains.split(",") for c in json.load(open(f))]
        a.starts = ",".join(str(c["start"]) for c in all_chains)
    else:
        from lynxkv.hf.models import load_model

        torch.set_num_threads(2)
        lm = load_model()
        with tempfile.TemporaryDirectory() as d:
            all_chains = [chains(lm.model, lm.tokenizer, int(s), a.tokens, a.positions, d) for s in a.starts.split(",")]
    below = lambda x: sum(m < x for c in all_chains for m in c["anchor_margin"][:min(first_disagreement(c), a.window)])  # noqa: E731
    agreeing = sum(min(first_disagreement(c), a.window) for c in all_chains)
    print(f"choosing corpus: built-in prompt, {a.tokens} tokens, starts {a.starts}; SmolLM2 fp32; "
          f"{a.positions} positions, window {a.window}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for c in all_chains:
        d = first_disagreement(c)
        dis = [i for i, r in enumerate(c["rank"]) if r]
        agree = sorted(m for i, m in enumerate(c["anchor_margin"][:d]))
        q = lambda p: agree[int(p * (len(agree) - 1))] if agree else float("nan")  # noqa: E731
        at = (f"margin {c['anchor_margin'][d]:.3f}, F's token rank {c['rank'][d]}" if d < len(c["full"]) else "-")
        print(f"start {c['start']}: first disagreement {d if d < len(c['full']) else 'none'} ({at}); teacher-forced "
              f"disagreements {dis}; margins before it: 5% {q(0.05):.3f}, median {q(0.5):.3f}")
    print()
    print("| X (logits) | policy | agreeing drafts below X | forks | true forks | fork at (first disagreement) | "
          "drafts kept without / with | costly two-chain steps |")
    print("|---:|---|---:|---:|---:|---|---|---:|")
    for x in (float(v) for v in a.margins.split(",")):
        for policy in ("first", "lowest"):
            sims = [simulate(c, x, a.window, policy) for c in all_chains]
            pos = ", ".join(f"{'-' if s['fork'] is None else s['fork']} ({s['d'] if s['d'] < a.window else '-'})"
                            for s in sims)
            print(f"| {x:g} | {policy} | {below(x)}/{agreeing} | {sum(s['forks'] for s in sims)} | "
                  f"{sum(s['true'] for s in sims)} | {pos} | {sum(s['kept'] for s in sims)} / "
                  f"{sum(s['kept_with'] for s in sims)} | {sum(s['costly'] for s in sims)} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(all_chains, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
