"""Where the full code's systematic error comes from: SmolLM2's fp32 keys of a few held-out documents (the task
text of ``lynxkv eval --task``), encoded and decoded with a scheme through the public API, measured in the domain
the codes live in (the rotated keys) and after rotating back.

Printed per scheme (the default with extremes = midpoint, then one factor changed at a time, the last the default):

- the relative change of the keys' energy, ``Σ(x̂² − x²) / Σx²`` (= ``2Σx·e + Σe²``, ``e = x̂ − x``), split into the
  chunk extremes (the max and the min of each chunk of one channel) and every other element, and the mean of the
  per-token norm ratio ``‖k̂‖/‖k‖ − 1`` after rotating back;
- the mean signed error in units of the nested grid's coordinate ``v`` (0 … A; one residual sub-bin is 1/R) by
  code (a, r) for the codes at the grid's ends, over every other code, by position in the chunk and by ``u``;
- the slope of ``x̂`` on ``x`` per chunk and channel (least squares over the chunk's tokens), mean − 1.

With ``--choosing N`` it then scores the fix where the defaults are chosen: N documents of 1023 + 256 tokens of
the choosing corpus (pydoc's topic help, :mod:`lynxkv.hf.prompts`), each cache stored in ``lynx-1.3`` (the end
sub-bins at their midpoints) and in ``lynx-default`` (at the chunk's extremes) as ``lynxkv eval
--task perplexity`` stores it, and the 256 continuation tokens teacher-forced: per codec the mean next-token KL
against the original cache, the mean ΔPPL ± s.e.m. and the mean |ΔPPL|, and the paired KL difference.

    python benchmarks/diag_key_bias.py                 # 3 documents, ~2 minutes on 2 cores
    python benchmarks/diag_key_bias.py --documents 6
    python benchmarks/diag_key_bias.py --choosing 20   # + ~6 minutes
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from lynxkv.eval.prose import clean_ids, default_corpus
from lynxkv.hf.models import load_model
from lynxkv.hf.prefill import prefill
from lynxkv.quant import dequantize, quantize, rotation
from lynxkv.quant.reference import compand, spread
from lynxkv.quant.scheme import get_scheme

DOC = 1024 + 256  # the perplexity task's documents: 1024 tokens of context (1023 prefilled) + 256 scored


def held_out_keys(documents: int) -> list[list[torch.Tensor]]:
    """Per document, per layer, the fp32 keys ``[H, T, D]`` of the task's perplexity prefill, documents spread
    over the text."""
    loaded = load_model(None)
    ids, _ = clean_ids(loaded.tokenizer, default_corpus())
    docs = [ids[i : i + DOC] for i in range(0, len(ids) - DOC + 1, DOC)]
    picks = docs[:: max(1, len(docs) // documents)][:documents]
    out = []
    for doc in picks:
        kv, _ = prefill(loaded.model, torch.tensor(doc[: 1024 - 1]))
        out.append([k.float().clone() for k, _ in kv])
    return out


def choosing_scores(documents: int) -> None:
    """ΔPPL and next-token KL of ``lynx-1.3`` and ``lynx-default`` on the choosing corpus (see the docstring)."""
    import math

    from lynxkv.eval.baselines import registry
    from lynxkv.eval.draft import forward_logits
    from lynxkv.eval.harness import roundtrip_cache
    from lynxkv.hf.prompts import corpus_sections

    loaded = load_model(None)
    ids = loaded.tokenizer("\n\n".join(f"## {name}\n\n{text}" for name, text in corpus_sections())).input_ids
    docs = [ids[i : i + DOC] for i in range(0, len(ids) - DOC + 1, DOC)]
    docs = docs[:: max(1, len(docs) // documents)][:documents]
    codecs = [registry()[name] for name in ("lynx-1.3", "lynx-default")]
    kl: dict[str, list[float]] = {c.name: [] for c in codecs}
    dppl: dict[str, list[float]] = {c.name: [] for c in codecs}
    for doc in docs:
        kv, _ = prefill(loaded.model, torch.tensor(doc[: 1024 - 1]))
        inputs, targets = torch.tensor(doc[1023:-1]), torch.tensor(doc[1024:])
        ref = torch.log_softmax(forward_logits(loaded.model, kv, inputs), -1)
        ref_nll = float(-ref.gather(1, targets[:, None]).sum())
        for codec in codecs:
            approx = torch.log_softmax(forward_logits(loaded.model, roundtrip_cache(codec, kv), inputs), -1)
            kl[codec.name].append(float((ref.exp() * (ref - approx)).sum(-1).mean()))
            nll = float(-approx.gather(1, targets[:, None]).sum())
            dppl[codec.name].append(math.exp((nll - ref_nll) / len(targets)) - 1)

    def mean_sem(v: list[float]) -> tuple[float, float]:
        m = sum(v) / len(v)
        return m, (sum((x - m) ** 2 for x in v) / max(len(v) - 1, 1) / len(v)) ** 0.5

    print(f"\nchoosing corpus (pydoc topic help), {len(docs)} documents of 1023 + 256 tokens, SmolLM2 fp32")
    for name in kl:
        (k, ks), (d, ds) = mean_sem(kl[name]), mean_sem(dppl[name])
        print(f"  {name:13s} KL {k:.3e} ± {ks:.1e}   ΔPPL {100 * d:+.4f}% ± {100 * ds:.4f}%   "
              f"mean |ΔPPL| {100 * sum(abs(x) for x in dppl[name]) / len(docs):.4f}%")
    diff = [b - a for a, b in zip(kl["lynx-1.3"], kl["lynx-default"])]
    m, sem = mean_sem(diff)
    print(f"  KL lynx-default − lynx-1.3: {m:+.3e} ± {sem:.1e}; lower on {sum(d < 0 for d in diff)} of {len(diff)}")


def measure(keys, scheme) -> dict:
    A, R, C = scheme.anchor_steps, scheme.residual_levels, scheme.chunk
    f64 = dict(dtype=torch.float64)
    code_sum, code_n = torch.zeros(256, **f64), torch.zeros(256, **f64)
    pos_sum, pos_n = torch.zeros(C, **f64), torch.zeros(C, **f64)
    edges = torch.linspace(-1, 1, 11)
    u_sum, u_n = torch.zeros(10, **f64), torch.zeros(10, **f64)
    xe = ee = xx = ext_xe = ext_ee = 0.0
    ratios, slopes = [], []
    for doc in keys:
        for k in doc:
            enc = quantize(k, scheme, "key")
            y = rotation.rotate(k) if enc.rotated else k.float()
            yhat = dequantize(dataclasses.replace(enc, rotated=False), scheme)
            khat = dequantize(enc, scheme)
            h, t, d = y.shape
            o, s = (spread(m, C, "token", t, d) for m in (enc.offset, enc.scale))
            u = torch.where(s > 0, (y - o) / s, torch.zeros_like(y))
            v = (compand(u, scheme) + 1) * (A / 2)
            a, r = enc.anchor.long(), enc.residual.long()
            vhat = torch.where(s > 0, (expand_v(yhat, o, s, scheme)), v)
            ev = (vhat - v).double().reshape(-1)
            code = (a * R + r).reshape(-1)
            code_sum.index_add_(0, code, ev), code_n.index_add_(0, code, torch.ones_like(ev))
            pos = (torch.arange(t) % C).view(1, t, 1).expand(h, t, d).reshape(-1)
            pos_sum.index_add_(0, pos, ev), pos_n.index_add_(0, pos, torch.ones_like(ev))
            ub = torch.bucketize(u.reshape(-1).clamp(-1, 1 - 1e-7), edges[1:-1])
            u_sum.index_add_(0, ub, ev), u_n.index_add_(0, ub, torch.ones_like(ev))
            e, yd = (yhat - y).double(), y.double()
            xe, ee, xx = xe + float((yd * e).sum()), ee + float((e * e).sum()), xx + float((yd * yd).sum())
            full = t // C * C
            yc = y[:, :full].reshape(h, -1, C, d)
            ext = torch.zeros_like(y, dtype=torch.bool)
            ext[:, :full] = ((yc == yc.amax(2, keepdim=True)) | (yc == yc.amin(2, keepdim=True))).reshape(h, full, d)
            ext_xe, ext_ee = ext_xe + float((yd * e)[ext].sum()), ext_ee + float((e * e)[ext].sum())
            ratios.append(((khat.double() ** 2).sum(-1) / (k.double() ** 2).sum(-1)).sqrt().reshape(-1) - 1)
            yhc = yhat[:, :full].reshape(h, -1, C, d).double()
            ycd = yc.double() - yc.double().mean(2, keepdim=True)
            var = (ycd**2).sum(2)
            slope = (ycd * (yhc - yhc.mean(2, keepdim=True))).sum(2) / var.clamp(min=1e-30)
            slopes.append(slope[var > 0].reshape(-1))
    lo, hi_below, hi_at = R // 2, A * R + R // 2 - 1, A * R + R // 2  # codes (0, R/2), (A, R/2 - 1), (A, R/2)
    ends = [lo, hi_below, hi_at]
    rest = [c for c in range(256) if c not in ends]
    return {
        "energy": (2 * xe + ee) / xx, "energy_extremes": (2 * ext_xe + ext_ee) / xx,
        "energy_rest": (2 * (xe - ext_xe) + (ee - ext_ee)) / xx,
        "norm_ratio": float(torch.cat(ratios).mean()), "slope": float(torch.cat(slopes).mean()) - 1,
        "ends": {(c // R, c % R): (float(code_sum[c] / code_n[c].clamp(min=1)), int(code_n[c])) for c in ends},
        "rest": float(code_sum[rest].sum() / code_n[rest].sum()),
        "position": (pos_sum / pos_n).tolist(), "u": (u_sum / u_n.clamp(min=1)).tolist(),
    }


def expand_v(yhat, o, s, scheme):
    """The grid coordinate ``v`` of decoded rotated keys (through the compander, as the encoder computes it)."""
    u = (yhat - o) / s
    return (compand(u, scheme) + 1) * (scheme.anchor_steps / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--choosing", type=int, default=0, help="also score lynx-1.3 and lynx-default on N documents "
                    "of the choosing corpus")
    args = ap.parse_args()
    torch.set_num_threads(2)
    keys = held_out_keys(args.documents)
    base = get_scheme("default").replace(extremes="midpoint")  # the default with extremes = midpoint
    variants = [("the 1.3 default (extremes = midpoint)", base), ("fp32 metadata (scale not rounded up)", base.replace(meta_dtype="fp32")),
                ("keys not rotated", base.replace(key_rotation="none")),
                ("linear compander", base.replace(compander="linear", alpha=0.0)),
                ("no sink tokens", base.replace(sink_tokens=0)),
                ("extremes = range (the default)", base.replace(extremes="range"))]
    print(f"SmolLM2 fp32 keys, {args.documents} held-out documents of 1023 tokens, 30 layers")
    for name, scheme in variants:
        m = measure(keys, scheme)
        print(f"\n== {name}: {scheme.describe()}")
        print(f"  keys' energy Σ(x̂²−x²)/Σx² {m['energy']:+.3e}: chunk extremes {m['energy_extremes']:+.3e}, "
              f"every other element {m['energy_rest']:+.3e}")
        print(f"  per-token norm ratio ‖k̂‖/‖k‖ − 1 (rotated back): {m['norm_ratio']:+.3e}; "
              f"slope of x̂ on x per chunk − 1: {m['slope']:+.3e}")
        ends = ", ".join(f"(a={a}, r={r}) {err:+.4f} (n={n})" for (a, r), (err, n) in m["ends"].items())
        print(f"  mean signed error in v (sub-bin 1/{scheme.residual_levels} = {1 / scheme.residual_levels:.4f}): "
              f"{ends}; every other code {m['rest']:+.1e}")
        print("  by position in the chunk: " + " ".join(f"{x:+.4f}" for x in m["position"]))
        print("  by u in 10 bins over [-1, 1]: " + " ".join(f"{x:+.4f}" for x in m["u"]))
    if args.choosing:
        choosing_scores(args.choosing)


if __name__ == "__main__":
    main()
