"""Presenting an evaluation: a rich table per corpus and context length, Markdown tables, and PNG plots."""

from __future__ import annotations

import math
import os

from rich.table import Table

COLUMNS = [  # (key, header, format)
    ("bits", "bits/el", "{:.2f}"),
    ("k_vnmse", "K vNMSE", "{:.2e}"),
    ("v_vnmse", "V vNMSE", "{:.2e}"),
    ("attn_err", "attn err", "{:.2e}"),
    ("agree", "agree", "{:.3f}"),
    ("kl", "KL", "{:.2e}"),
    ("prefix", "prefix/W", None),
    ("prefix_untied", "untied", None),
    ("prefix_ties", "ties", None),
    ("prefix_full", "vs full", None),
    ("ppl_delta", "ΔPPL", "{:+.2%}"),
    ("choices", "chosen", None),
]

#: How a table or plot names each corpus role: which text it is, and what it may be used for.
ROLE_LABELS = {
    "heldout": "HELD-OUT (no part in choosing; report these)",
    "choosing": "CHOOSING (the text schemes are tuned on)",
    "kv": "KV dump",
}


def blocks(result: dict):
    """``(corpus, length block)`` pairs in the order they are shown."""
    for corpus in result["corpora"]:
        for block in corpus["lengths"]:
            yield corpus, block


#: The prefix columns: mean ± s.e.m. over windows against the exact cache, the same over the windows that did not
#: end on a near-tie, how many did (of all windows), and a lynx anchor's against its own full code.
PREFIX_CELLS = ("prefix", "prefix_untied", "prefix_full")


def _cell(summary: dict, key: str, fmt: str | None) -> str:
    if key in PREFIX_CELLS:
        mean, sem = summary.get(f"{key}_mean"), summary.get(f"{key}_sem")
        return "-" if mean is None else f"{mean:.1f} ± {sem:.1f}"
    if key == "choices":  # how many prompts chose each candidate of lynxkv.hf.choose.CANDIDATES
        from lynxkv.hf.choose import LABELS

        counts = [summary[key].count(i) for i in range(len(LABELS))] if key in summary else []
        return ", ".join(f"{label} {n}" for label, n in zip(LABELS, counts) if n) or "-"
    if key == "prefix_ties":
        return f"{summary['prefix_ties']}/{summary['windows']}" if "prefix_ties" in summary else "-"
    value = summary.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if summary.get("prompts", 0) > 1 and f"{key}_sem" in summary:  # mean ± s.e.m. over prompts
        return f"{fmt.format(value)} ± {fmt.replace('+', '').format(summary[key + '_sem'])}"
    return fmt.format(value)


def _visible(result: dict) -> list[tuple[str, str, str | None]]:
    """The columns some codec of some table has a value for."""
    keys = {k for _, block in blocks(result) for summary in block["codecs"].values() for k in summary}
    return [c for c in COLUMNS if c[0] in keys or f"{c[0]}_mean" in keys]


def _title(result: dict, corpus: dict, block: dict) -> str:
    sizes = block["prompt_tokens"]
    if result["kind"] == "kv":
        return f"{corpus['name']}: {sizes[0]} tokens (KV-only)"
    skipped = block.get("skipped_overlapping")
    windows_note = f", {result['windows']} windows per prompt" if result.get("windows", 1) > 1 else ""
    note = f", {skipped} piece(s) skipped as overlapping" if skipped else ""
    return (
        f"{ROLE_LABELS[corpus['role']]}: {corpus['name']}; {result['model']}, ~{block['tokens']} tokens, "
        f"{len(sizes)} prompt(s) of {min(sizes)}-{max(sizes)} tokens{note}, window W={result['window']}"
        f"{windows_note}"
    )


def tables(result: dict) -> list[Table]:
    """One rich table per corpus and length. vNMSE: per-layer global ratio, averaged over layers; the draft
    metrics and ΔPPL: mean ± s.e.m. over prompts."""
    out = []
    cols = _visible(result)
    for corpus, block in blocks(result):
        t = Table(title=_title(result, corpus, block), title_justify="left")
        t.add_column("codec", no_wrap=True)
        for _, header, _ in cols:
            t.add_column(header, justify="right")
        for name, summary in block["codecs"].items():
            t.add_row(name, *(_cell(summary, key, fmt) for key, _, fmt in cols))
        out.append(t)
    return out


def markdown(result: dict) -> str:
    """The same tables as GitHub Markdown (for the README)."""
    cols = _visible(result)
    lines = []
    for corpus, block in blocks(result):
        lines.append(f"**{_title(result, corpus, block)}**\n")
        lines.append("| codec | " + " | ".join(h for _, h, _ in cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for name, summary in block["codecs"].items():
            lines.append(f"| {name} | " + " | ".join(_cell(summary, k, f) for k, _, f in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def _colour(name: str) -> str:
    """Lynx anchors red, lynx full codes green, KIVI blue, every other baseline grey: the comparison that
    decides a scheme stands out."""
    if name.startswith("lynx"):
        return "tab:red" if name.endswith("-anchor") else "tab:green"
    return "tab:blue" if name.startswith("kivi") else "tab:gray"


def _place_labels(ax, points: list[tuple[float, float, str]], fontsize: float = 7.0) -> None:
    """Name every point beside it; a label that would cover a marker or a label placed before moves up or down,
    one line at a time, with a thin leader line back to its point (codecs at equal bits sit in one column)."""
    ax.autoscale_view()
    dpi = ax.figure.dpi
    line, char = fontsize * 1.3 * dpi / 72, fontsize * 0.62 * dpi / 72  # label height and character width, px
    markers = [ax.transData.transform((x, y)) for x, y, _ in points]
    placed = [(mx - 4, my - 4, mx + 4, my + 4) for mx, my in markers]  # labels cover no marker either
    for x, y, name in sorted(points, key=lambda p: (p[0], -p[1])):
        px, py = ax.transData.transform((x, y))
        width = len(name) * char
        for k in range(200):
            dy = ((k + 1) // 2) * line * (1 if k % 2 else -1)  # 0, +1, -1, +2, -2 ... lines
            box = (px + 6, py + dy - line / 2, px + 6 + width, py + dy + line / 2)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        placed.append(box)
        ax.annotate(name, (x, y), xytext=(6 * 72 / dpi, dy * 72 / dpi), textcoords="offset points",
                    fontsize=fontsize, va="center", color=_colour(name),
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.6"} if dy else None)


def _bits_axis(ax, bits: list[float]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ticks = [b for b in (2, 3, 4, 5, 6, 8, 9, 12, 16, 32) if min(bits) / 1.1 <= b <= max(bits) * 1.1]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("bits per element (with metadata; log scale)")
    ax.grid(alpha=0.3)


#: On a log axis, values below this are the exact cache's rounding noise; they are left out of the plot.
LOG_FLOOR = 1e-8


def plot(result: dict, directory: str) -> list[str]:
    """Write, for every corpus and length, ``quality_vs_bits_<role>_<tokens>.png`` (the quality frontier that
    matters for Lynx: draft agreement, next-token KL and accepted prefix against bits per element, mean ± s.e.m.
    over prompts, every codec named beside its point), ``prefix_curve_<role>_<tokens>.png`` (P(accepted ≥ k)
    per codec) and ``error_vs_bits_<role>_<tokens>.png`` (K and V vNMSE against bits); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for corpus, block in blocks(result):
        tokens, role, codecs = block["tokens"], corpus["role"], block["codecs"]
        where = f"{ROLE_LABELS[role]}\n{corpus['name']}, ~{tokens} tokens, {len(block['prompt_tokens'])} prompt(s)"
        drafted = {n: s for n, s in codecs.items() if "agree" in s and "prefix_mean" in s}
        if drafted:
            fig, axes = plt.subplots(1, 3, figsize=(19, 7))
            panels = (("agree", "agree_sem", "top-1 draft agreement", False),
                      ("kl", "kl_sem", "next-token KL (log scale)", True),
                      ("prefix_mean", "prefix_sem", f"accepted prefix of W = {result.get('window')} (tokens)", False))
            for ax, (key, sem, label, log) in zip(axes, panels):
                shown = {n: s for n, s in drafted.items() if not log or s[key] >= LOG_FLOOR}
                for name, s in shown.items():
                    ax.errorbar(s["bits"], s[key], yerr=s.get(sem, 0.0), fmt="o", ms=4, capsize=2,
                                color=_colour(name))
                if log:
                    ax.set_yscale("log")
                _bits_axis(ax, [s["bits"] for s in drafted.values()])
                ax.set_ylabel(label)
                _place_labels(ax, [(s["bits"], s[key], n) for n, s in shown.items()])
            fig.suptitle(f"Draft quality against bits (mean ± s.e.m. over prompts): {where}")
            paths.append(_save(fig, directory, f"quality_vs_bits_{role}_{tokens}.png"))
        curves = {n: s["prefix_curve"] for n, s in codecs.items() if "prefix_curve" in s}
        if curves:
            fig, ax = plt.subplots(figsize=(9, 6))
            for i, (name, curve) in enumerate(curves.items()):  # 10 colours, then the next line style
                style = ("-", "--", ":", "-.")[i // 10 % 4]
                ax.step(range(len(curve)), curve, where="post", label=name, linestyle=style)
            ax.set_xlabel("k (tokens)")
            ax.set_ylabel("P(accepted prefix ≥ k)")
            ax.set_title(f"Accepted prefix: {where}", fontsize=9)
            ax.set_ylim(0, 1.02)
            ax.legend(fontsize=7, ncol=2)
            paths.append(_save(fig, directory, f"prefix_curve_{role}_{tokens}.png"))
        fig, ax = plt.subplots(figsize=(9, 6))
        points = []
        for key, marker in (("k_vnmse", "o"), ("v_vnmse", "s")):
            pts = [(s["bits"], s[key], n) for n, s in codecs.items() if s.get(key, 0) >= LOG_FLOOR]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=key.replace("_", " "))
            points += [(b, e, f"{n} ({key[0].upper()})") for b, e, n in pts]
        ax.set_yscale("log")
        _bits_axis(ax, [s["bits"] for s in codecs.values()])
        ax.set_ylabel("vNMSE (global, mean over layers; log scale)")
        ax.set_title(f"Reconstruction error against bits: {where}", fontsize=9)
        ax.legend()
        _place_labels(ax, points, fontsize=6)
        paths.append(_save(fig, directory, f"error_vs_bits_{role}_{tokens}.png"))
    return paths


def _save(fig, directory: str, name: str, dpi: int = 120) -> str:
    """Write through a temporary file and rename, so a crash never leaves a half PNG under the real name."""
    import matplotlib.pyplot as plt

    from lynxkv.storage import atomic_path

    path = os.path.join(directory, name)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
    plt.close(fig)
    return path
