"""Where an anchor layout costs the model, layer by layer: why the choice of the anchor per cache asks the model.

    .venv/bin/python benchmarks/diag_anchor_layers.py --model gemma3-270m --prompts 2 --tokens 2000
    .venv/bin/python benchmarks/diag_anchor_layers.py --model smollm2 --prompts 12 --window 256 --whole [--text]

On the built-in (choosing) prompts: the exact cache of each prompt; for each candidate anchor (α = 0.5 or 1 or the
linear code, keys rotated or not) the next-token KL of a teacher-forced window of 64 greedy tokens with every layer
taken from that anchor, and with one layer at a time taken from it (the rest exact). Beside the per-layer KL, three
statistics one might choose a layer's layout by instead: the keys' relative squared error (``kerr``), the
attention error with the window's real queries (``aerr``), and the attention-logit error with the cache's own keys
standing in for the queries (``lg``). Prints, per layer, what each says about rotating the keys (the ratio rotated /
not rotated, α = 0.5; below 1: rotate).

With ``--whole``, the whole-cache KL alone, for more candidates (α = 0.25; the linear code without its 4 sink
tokens, which is KIVI-4's grid): each candidate against ``α1`` (the unrotated keys at α = 1), paired per
prompt, as a relative change ± its standard error and the prompts it lowers the KL on.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lynxkv.eval import metrics
from lynxkv.eval.baselines import Kivi, Lynx, roundtrip_cache
from lynxkv.eval.cases import builtin_case, prompt_starts
from lynxkv.eval.draft import build_reference, forward_logits, window_inputs
from lynxkv.hf.models import load_model
from lynxkv.quant.scheme import DEFAULT

CANDIDATES = {
    "α0.5 rotated": DEFAULT,
    "α0.5": DEFAULT.replace(key_rotation="none"),
    "α1": DEFAULT.replace(key_rotation="none", alpha=1.0),
    "α1 rotated": DEFAULT.replace(alpha=1.0),
    "linear": DEFAULT.replace(key_rotation="none", compander="linear", alpha=0.0),
    "linear rotated": DEFAULT.replace(compander="linear", alpha=0.0),
}
MORE = {  # --whole only
    "α0.25": DEFAULT.replace(key_rotation="none", alpha=0.25),
    "linear, no sinks": DEFAULT.replace(key_rotation="none", compander="linear", alpha=0.0, sink_tokens=0),
}
STATS = ("kl", "kerr", "aerr", "lg")


def layer_stats(ref, layer: int, approx) -> dict:
    """The statistics of layer ``layer``'s approximation ``approx`` (keys, values ``[H, T, D]``), but its KL."""
    (k, v), (kh, vh), q = ref.prefix_kv[layer], approx, ref.queries[layer]
    aerr, _ = metrics.attention_error_vs(metrics.attention(q, k, v, ref.scaling), q, kh, vh, ref.scaling)
    sample = k[:, torch.linspace(0, k.shape[1] - 1, 64).long()].float()  # 64 of the cache's keys as queries
    lg = float(((sample @ (kh - k).float().transpose(1, 2)) ** 2).mean()
               / ((sample @ k.float().transpose(1, 2)) ** 2).mean())
    kerr = float(((kh - k).float() ** 2).sum() / (k.float() ** 2).sum())
    return {"kerr": kerr, "aerr": aerr, "lg": lg}


@torch.no_grad()
def measure(model, tokenizer, prompts: int, tokens: int, window: int = 64, layers: bool = True,
            text: bool = False) -> tuple[dict, dict]:
    """(per candidate and KIVI-4: the KL with every layer approximated, per prompt; per candidate: per layer, the
    statistics per prompt, or nothing without ``layers``). The KL is taken over ``window`` greedy tokens, or with
    ``text`` over the document's own next ``window`` tokens."""
    candidates = CANDIDATES if layers else {**CANDIDATES, **MORE}
    whole: dict = {name: [] for name in [*candidates, "kivi4"]}
    per_layer: dict = {name: None for name in CANDIDATES} if layers else {}
    for start in prompt_starts(prompts):
        ids, following = builtin_case(tokenizer, tokens, start, window if text else 0)
        ref = build_reference(model, ids, 1 if text else window)
        inputs = window_inputs(ref.last_token, following if text else ref.tokens)
        exact = forward_logits(model, ref.prefix_kv, inputs) if text else ref.exact_logits

        def kl(kv) -> float:
            return float(metrics.next_token_kl(exact, forward_logits(model, kv, inputs)).mean())

        approx = {name: roundtrip_cache(Lynx(name, s, anchor_only=True), ref.prefix_kv)
                  for name, s in candidates.items()}
        for name, kv in approx.items():
            whole[name].append(kl(kv))
        whole["kivi4"].append(kl(roundtrip_cache(Kivi("kivi4", 4, ""), ref.prefix_kv)))
        for name, kv in approx.items() if layers else ():
            rows = per_layer[name] = per_layer[name] or [{s: [] for s in STATS} for _ in kv]
            for layer, pair in enumerate(kv):
                mixed = list(ref.prefix_kv)
                mixed[layer] = pair
                rows[layer]["kl"].append(kl(mixed))
                for s, value in layer_stats(ref, layer, pair).items():
                    rows[layer][s].append(value)
    return whole, per_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--window", type=int, default=64, help="teacher-forced greedy tokens the KL is taken over")
    ap.add_argument("--whole", action="store_true", help="the whole-cache KL only, more candidates, paired")
    ap.add_argument("--text", action="store_true", help="the KL over the document's own next tokens, not greedy ones")
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(args.model)
    whole, per_layer = measure(loaded.model, loaded.tokenizer, args.prompts, args.tokens, args.window,
                               layers=not args.whole, text=args.text)
    over = "the text's own next tokens" if args.text else "greedy tokens"
    print(f"{args.model}, {args.prompts} built-in prompts of ~{args.tokens} tokens, window {args.window} of {over}: "
          f"next-token KL, every layer from the anchor (mean ± s.e.m. over prompts)")
    for name, values in whole.items():
        print(f"  {name:17s} {statistics.mean(values):.2e} ± {_sem(values):.1e}")
    if args.whole:
        print("\nagainst α1, paired per prompt: relative KL change ± s.e.m., prompts it is lower on")
        for name, values in whole.items():
            if name != "α1":
                change = [a / b - 1 for a, b in zip(values, whole["α1"])]
                lower = sum(c < 0 for c in change)
                print(f"  {name:17s} {100 * statistics.mean(change):+6.1f}% ± {100 * _sem(change):.1f}  "
                      f"{lower}/{len(change)}")
        return
    print("\nper layer, rotated / not rotated keys (α = 0.5): KL with that layer alone from the anchor, and what "
          "kerr, aerr and lg say")
    print("layer  " + "  ".join(f"{s:>6s}" for s in STATS))
    rot, plain = per_layer["α0.5 rotated"], per_layer["α0.5"]
    for layer, (r, p) in enumerate(zip(rot, plain)):
        ratios = [statistics.mean(r[s]) / statistics.mean(p[s]) for s in STATS]
        print(f"{layer:5d}  " + "  ".join(f"{x:6.2f}" for x in ratios))


def _sem(values: list[float]) -> float:
    return metrics.mean_std(values)[1] / len(values) ** 0.5


if __name__ == "__main__":
    main()
