"""Presenting an evaluation: a rich table per context length, a Markdown table, and PNG plots."""

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
    ("ppl_delta", "ΔPPL", "{:+.2%}"),
]


def _cell(summary: dict, key: str, fmt: str | None) -> str:
    if key == "prefix":
        if "prefix_mean" not in summary:
            return "-"
        return f"{summary['prefix_mean']:.1f} ± {summary['prefix_sem']:.1f}"
    value = summary.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if summary.get("prompts", 0) > 1 and f"{key}_sem" in summary:  # mean ± s.e.m. over prompts
        return f"{fmt.format(value)} ± {fmt.format(summary[key + '_sem'])}"
    return fmt.format(value)


def _visible(result: dict) -> list[tuple[str, str, str | None]]:
    first = result["lengths"][0]["codecs"]
    any_summary = next(iter(first.values()), {})
    cols = [c for c in COLUMNS if c[0] in any_summary or (c[0] == "prefix" and "prefix_mean" in any_summary)]
    return cols


def _title(result: dict, block: dict) -> str:
    sizes = block["prompt_tokens"]
    if result["kind"] == "kv":
        return f"{result.get('source')}: {sizes[0]} tokens (KV-only)"
    corpus = f" of {result['corpus']}" if result.get("corpus") else ""
    return (
        f"{result['model']}: ~{block['tokens']} tokens, {len(sizes)} prompt(s){corpus} of {min(sizes)}-{max(sizes)} "
        f"tokens, window W={result['window']}"
    )


def tables(result: dict) -> list[Table]:
    """One rich table per length. vNMSE: per-layer global ratio, averaged over layers; prefix: mean ± s.e.m."""
    out = []
    cols = _visible(result)
    for block in result["lengths"]:
        t = Table(title=_title(result, block), title_justify="left")
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
    for block in result["lengths"]:
        lines.append(f"**{_title(result, block)}**\n")
        lines.append("| codec | " + " | ".join(h for _, h, _ in cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for name, summary in block["codecs"].items():
            lines.append(f"| {name} | " + " | ".join(_cell(summary, k, f) for k, _, f in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, directory: str) -> list[str]:
    """Write, for every length, ``quality_vs_bits_<tokens>.png`` (the quality frontier that matters for Lynx:
    draft agreement, next-token KL and accepted prefix against bits per element, mean ± s.e.m. over prompts,
    every codec labelled), ``prefix_curve_<tokens>.png`` (P(accepted ≥ k) per codec) and
    ``error_vs_bits_<tokens>.png`` (K and V vNMSE against bits, log scale); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for block in result["lengths"]:
        tokens = block["tokens"]
        codecs = block["codecs"]
        drafted = {n: s for n, s in codecs.items() if "agree" in s and "prefix_mean" in s}
        if drafted:
            fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
            panels = (("agree", "agree_sem", "top-1 draft agreement", False),
                      ("kl", "kl_sem", "next-token KL (log)", True),
                      ("prefix_mean", "prefix_sem", f"accepted prefix of W = {result.get('window')}", False))
            for ax, (key, sem, label, log) in zip(axes, panels):
                for i, (name, s) in enumerate(drafted.items()):
                    ax.errorbar(s["bits"], s[key], yerr=s.get(sem, 0.0), fmt="os^vD"[i // 10 % 5], capsize=2,
                                label=name)
                    ax.annotate(name, (s["bits"], s[key]), fontsize=7, xytext=(4, 3), textcoords="offset points")
                if log:
                    ax.set_yscale("log")
                ax.set_xlabel("bits per element (with metadata)")
                ax.set_ylabel(label)
                ax.grid(alpha=0.3)
            axes[0].legend(fontsize=7, ncol=2)
            fig.suptitle(f"Draft quality against bits, ~{tokens} tokens, {len(block['prompt_tokens'])} prompt(s)"
                         f"{' of ' + result['corpus'] if result.get('corpus') else ''}")
            paths.append(_save(fig, directory, f"quality_vs_bits_{tokens}.png"))
        curves = {n: s["prefix_curve"] for n, s in codecs.items() if "prefix_curve" in s}
        if curves:
            fig, ax = plt.subplots(figsize=(8, 5))
            for i, (name, curve) in enumerate(curves.items()):  # 10 colours, then the next line style
                style = ("-", "--", ":", "-.")[i // 10 % 4]
                ax.step(range(len(curve)), curve, where="post", label=name, linestyle=style)
            ax.set_xlabel("k (tokens)")
            ax.set_ylabel("P(accepted prefix ≥ k)")
            ax.set_title(f"Accepted prefix, ~{tokens} tokens")
            ax.set_ylim(0, 1.02)
            ax.legend(fontsize=7, ncol=2)
            paths.append(_save(fig, directory, f"prefix_curve_{tokens}.png"))
        fig, ax = plt.subplots(figsize=(8, 5))
        for key, marker in (("k_vnmse", "o"), ("v_vnmse", "s")):
            pts = [(s["bits"], s[key], n) for n, s in codecs.items() if s.get(key, 0) > 0]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=key.replace("_", " "))
            for b, e, n in pts:
                ax.annotate(n, (b, e), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per element (with metadata)")
        ax.set_ylabel("vNMSE (global, mean over layers)")
        ax.set_title(f"Error against bits, ~{tokens} tokens")
        ax.legend()
        paths.append(_save(fig, directory, f"error_vs_bits_{tokens}.png"))
    return paths


def _save(fig, directory: str, name: str) -> str:
    """Write through a temporary file and rename, so a crash never leaves a half PNG under the real name."""
    import matplotlib.pyplot as plt

    from lynxkv.storage import atomic_path

    path = os.path.join(directory, name)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)
    return path
