"""Presenting a task run (:mod:`lynxkv.eval.tasks`): one table (rich, or plain text), and two PNG plots.

The table has a row per codec: bits per element, perplexity and its change against the original cache
(mean ± s.e.m. over documents), passkey hits per length, and the overall passkey accuracy with its Wilson 95%
interval. The plots: ``task_accuracy_vs_bits.png`` (ΔPPL and passkey accuracy against bits per element) and
``passkey_depth_length.png`` (accuracy per depth × length, one panel per codec).
"""

from __future__ import annotations

import os

from rich.table import Table

from lynxkv.eval.report import _bits_axis, _colour, _place_labels, _save
from lynxkv.eval.tasks import REFERENCE, tokens_label


def codec_label(name: str, result: dict) -> str:
    """Rows name the identity codec after what it is: the cache the model produced, in its dtype."""
    return f"original ({result['dtype']})" if name == REFERENCE else name


def title(result: dict) -> str:
    g = result["grid"]
    parts = [f"{result['model']} ({result['dtype']}); text: {result['corpus']}, {result['corpus_tokens']} tokens"]
    if "perplexity" in result:
        p = result["perplexity"]
        parts.append(f"perplexity: {p['documents']} documents, {p['context']} tokens of context + {p['scored']} "
                     "scored")
    if "passkey" in result:
        parts.append(f"passkey: {', '.join(tokens_label(n) for n in g['lengths'])} tokens × depths "
                     f"{', '.join(f'{d:g}' for d in g['depths'])} × {g['trials']} trials")
    return "; ".join(parts)


def _columns(result: dict) -> list[str]:
    cols = ["codec", "bits/el"]
    if "perplexity" in result:
        cols += ["PPL", "ΔPPL"]
    if "passkey" in result:
        cols += [f"passkey {tokens_label(n)}" for n in result["passkey"]["lengths"]]
        cols += ["passkey acc [95% CI]"]
    return cols


def rows(result: dict) -> list[list[str]]:
    ppl = result.get("perplexity", {}).get("codecs", {})
    pk = result.get("passkey", {}).get("codecs", {})
    out = []
    for name in result["codecs"]:
        bits = (ppl.get(name) or pk.get(name))["bits"]
        row = [codec_label(name, result), f"{bits:.2f}"]
        if ppl:
            s = ppl[name]
            row += [f"{s['ppl']:.4f}", "—" if name == REFERENCE else
                    f"{s['ppl_delta']:+.3%} ± {s['ppl_delta_sem']:.3%}"]
        if pk:
            s = pk[name]
            row += [f"{b['hits']}/{b['trials']}" for b in s["by_length"]]
            lo, hi = s["interval"]
            row += [f"{s['accuracy']:.3f} [{lo:.2f}, {hi:.2f}]"]
        out.append(row)
    return out


def table(result: dict) -> Table:
    t = Table(title=title(result), title_justify="left")
    for i, col in enumerate(_columns(result)):
        t.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows(result):
        t.add_row(*row)
    return t


def plain(result: dict) -> str:
    """The table as aligned plain text (for a pipe or a file), then the targets."""
    cols, body = _columns(result), rows(result)
    widths = [max(len(r[i]) for r in [cols] + body) for i in range(len(cols))]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [title(result), fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in body]
    return "\n".join(lines + [""] + target_lines(result))


def markdown(result: dict) -> str:
    cols, body = _columns(result), rows(result)
    lines = [f"**{title(result)}**", "", "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines + [""] + [f"- {line}" for line in target_lines(result)])


def target_lines(result: dict) -> list[str]:
    return [f"target {'met' if t['met'] else 'NOT met'}: {t['target']}: {t['value']}" for t in result["targets"]]


def plot(result: dict, directory: str) -> list[str]:
    """Write ``task_accuracy_vs_bits.png`` and (for passkey) ``passkey_depth_length.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    where = f"{result['model']} ({result['dtype']}); {result['corpus']}"
    panels = []
    if "perplexity" in result:
        panels.append(("perplexity", "ΔPPL against the original cache (%)"))
    if "passkey" in result:
        panels.append(("passkey", "passkey exact-match accuracy (95% Wilson interval)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), squeeze=False)
    for ax, (task, label) in zip(axes[0], panels):
        codecs = result[task]["codecs"]
        points = []
        for name, s in codecs.items():
            if task == "perplexity":
                y, err = 100 * s["ppl_delta"], 100 * s["ppl_delta_sem"]
                ax.errorbar(s["bits"], y, yerr=err, fmt="o", ms=4, capsize=2, color=_colour(name))
            else:
                y = s["accuracy"]
                lo, hi = s["interval"]
                ax.errorbar(s["bits"], y, yerr=[[y - lo], [hi - y]], fmt="o", ms=4, capsize=2, color=_colour(name))
            points.append((s["bits"], y, codec_label(name, result)))
        if task == "perplexity":
            ax.set_yscale("symlog", linthresh=0.1)
            ax.axhline(0.0, color="0.7", lw=0.6)
        else:
            ax.set_ylim(-0.05, 1.05)
        _bits_axis(ax, [p[0] for p in points])
        ax.set_ylabel(label + (" (symlog)" if task == "perplexity" else ""))
        _place_labels(ax, points)
    fig.suptitle(f"Task accuracy against bits per element: {where}", fontsize=9)
    paths.append(_save(fig, directory, "task_accuracy_vs_bits.png", dpi=90))
    if "passkey" in result:
        paths.append(_depth_length(result, directory, where, plt))
    return paths


def _depth_length(result: dict, directory: str, where: str, plt) -> str:
    pk = result["passkey"]
    codecs = pk["codecs"]
    n = len(codecs)
    cols = min(4, n)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.3 * cols, 2.9 * nrows + 0.6), squeeze=False)
    fig.subplots_adjust(hspace=0.55, wspace=0.3)
    image = None
    for i, (ax, (name, s)) in enumerate(zip(axes.flat, codecs.items())):
        acc = [[h / pk["trials_per_cell"] for h in row] for row in s["cells"]]  # [length][depth]
        image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        for li, row in enumerate(s["cells"]):
            for di, h in enumerate(row):
                ax.text(di, li, f"{h}/{pk['trials_per_cell']}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(pk["depths"])), [f"{d:g}" for d in pk["depths"]], fontsize=7)
        ax.set_yticks(range(len(pk["lengths"])), [tokens_label(t) for t in pk["lengths"]], fontsize=7)
        ax.set_title(f"{codec_label(name, result)} ({s['bits']:.2f} b/el): {s['accuracy']:.2f}", fontsize=8)
        ax.set_xlabel("depth of the key", fontsize=7)
        if i % cols == 0:
            ax.set_ylabel("prompt tokens", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="exact-match accuracy")
    fig.suptitle(f"Passkey retrieval by depth × length: {where}", fontsize=9)
    return _save(fig, directory, "passkey_depth_length.png", dpi=90)
