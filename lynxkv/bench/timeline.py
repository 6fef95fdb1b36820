"""One run's timeline, as data and as a picture: where Lynx (and each monolithic baseline) spends its time.

:func:`run_timeline` takes a run's :class:`~lynxkv.speculative.RunStats` and gives the events on one time axis
(seconds since the run started): the anchor ready, each draft forward, the residual's bytes arrived per layer
(from the load's ``residual_layers``, when the transport reports them), the residual ready, the verify pass,
each plain decode step, every committed token. :func:`render_png` draws several of them, one row each, under
one time axis (matplotlib, imported only here, through its object API: no pyplot, no global backend change).
``lynxkv run --timeline FILE.png`` writes it; ``--json`` carries the same dicts under ``timelines``.
"""

from __future__ import annotations

import io

from lynxkv.speculative.stats import RunStats


def run_timeline(stats: RunStats, method: str = "lynx", *, data_ready_s: float | None = None) -> dict:
    """The timeline of one run. ``data_ready_s``: when a monolithic baseline's whole transfer ended (for Lynx
    the residual's own ready time is used)."""
    extra = (stats.load or {}).get("extra") or {}
    verify = None
    if stats.verify_start_s is not None and stats.verify_end_s is not None:
        verify = [stats.verify_start_s, stats.verify_end_s]
    return {
        "method": method,
        "anchor_ready_s": stats.anchor_ready_s,
        "residual_ready_s": stats.residual_ready_s if data_ready_s is None else data_ready_s,
        "residual_layers": [dict(r) for r in extra.get("residual_layers") or []],
        "draft_steps": [list(s) for s in stats.draft_steps],
        "branch_steps": [list(s) for s in stats.branch_draft_steps],  # the draft forwards that ran two chains
        "verify": verify,
        "verify_layered": stats.verify_layered,  # the verify ran while the residual arrived, layer by layer
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "branch_accepted": stats.branch_accepted,
        "decode_steps": [list(s) for s in stats.decode_steps],
        "tokens_s": list(stats.commit_times_s),
        "verified": stats.verified,
    }


def compare_timelines(compare: dict) -> list[dict]:
    """One timeline per method of a ``--compare`` report (its first round), in the report's row order."""
    out = []
    for row in compare["rows"]:
        method = row["method"]
        stats = compare["stats"][method][0]
        tl = stats_timeline(stats, method)
        if method != "lynx":
            tl["residual_ready_s"] = row["runs"][0]["ready_s"]
        out.append(tl)
    return out


def stats_timeline(d: dict, method: str) -> dict:
    """:func:`run_timeline` of a run's stats as :meth:`RunStats.to_dict` gave them."""
    fields = {f: d[f] for f in RunStats.__dataclass_fields__ if f in d}
    return run_timeline(RunStats(**fields), method)


_COLOURS = {"draft": "#6baed6", "branch": "#08519c", "verify": "#d62728", "decode": "#74c476", "layer": "#ff7f0e",
            "token": "#222222"}


def render_png(timelines: list[dict], *, title: str | None = None, dpi: int = 80) -> bytes:
    """A PNG with one row per timeline: draft forwards, the verify pass and plain decode steps as bars, the
    residual's layers as ticks above the bar (as each one's last byte arrived), every committed token as a tick
    below it, the anchor ready and the data (residual) ready as markers."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(timelines)
    fig = Figure(figsize=(10, 1.1 + 0.75 * n), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    end = 0.0
    for i, tl in enumerate(timelines):
        y = n - 1 - i
        spans = lambda steps: [(s[0], max(s[1] - s[0], 1e-4)) for s in steps]  # noqa: E731
        ax.broken_barh(spans(tl["draft_steps"]), (y - 0.15, 0.3), facecolors=_COLOURS["draft"],
                       edgecolors="white", linewidth=0.3)
        if tl.get("branch_steps"):
            ax.broken_barh(spans(tl["branch_steps"]), (y - 0.15, 0.3), facecolors=_COLOURS["branch"],
                           edgecolors="white", linewidth=0.3)
        if tl["verify"]:
            ax.broken_barh(spans([tl["verify"]]), (y - 0.15, 0.3), facecolors=_COLOURS["verify"])
        ax.broken_barh(spans(tl["decode_steps"]), (y - 0.15, 0.3), facecolors=_COLOURS["decode"],
                       edgecolors="white", linewidth=0.3)
        layers = [r["arrived_s"] for r in tl["residual_layers"]]
        if layers:
            ax.vlines(layers, y + 0.2, y + 0.32, colors=_COLOURS["layer"], linewidth=0.8)
        if tl["tokens_s"]:
            ax.vlines(tl["tokens_s"], y - 0.32, y - 0.2, colors=_COLOURS["token"], linewidth=0.6)
        for t, marker in ((tl["anchor_ready_s"], "^"), (tl["residual_ready_s"], "D")):
            if t is not None:
                ax.plot([t], [y + 0.26], marker=marker, color="black", markersize=5, linestyle="none")
        end = max([end, *tl["tokens_s"], *(s[1] for s in tl["decode_steps"])])
    ax.set_yticks(range(n))
    ax.set_yticklabels([_label(tl) for tl in reversed(timelines)], fontsize=8)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, end * 1.02 if end else 1)
    ax.set_xlabel("seconds since the load started")
    ax.grid(axis="x", alpha=0.3)
    branched = [Patch(color=_COLOURS["branch"], label="draft step, two chains")] if any(
        tl.get("branch_steps") for tl in timelines) else []
    ax.legend(handles=[
        Patch(color=_COLOURS["draft"], label="draft step (anchor)"), *branched,
        Patch(color=_COLOURS["verify"], label="verify"),
        Patch(color=_COLOURS["decode"], label="decode step (full)"),
        Line2D([], [], color=_COLOURS["layer"], label="residual layer arrived"),
        Line2D([], [], color=_COLOURS["token"], label="token committed"),
        Line2D([], [], marker="^", color="black", linestyle="none", label="anchor ready"),
        Line2D([], [], marker="D", color="black", linestyle="none", label="residual / data ready"),
    ], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28 if n > 2 else -0.45), ncol=4, frameon=False)
    return _png(fig, ax, title, dpi)


def _png(fig, ax, title: str | None, dpi: int) -> bytes:
    """The figure as PNG bytes, with ``title`` over ``ax``."""
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _label(tl: dict) -> str:
    name = tl["method"] + ("" if tl["verified"] else " (lossy)")
    if tl["method"] == "lynx" and tl["drafted"]:
        name += f"\n{tl['accepted']}/{tl['drafted']} drafts kept"
        if tl.get("branch_accepted") is not None:
            name += f", +1+{tl['branch_accepted']} on the branch"
    return name


def render_batch_png(requests: list[dict], *, title: str | None = None, dpi: int = 80) -> bytes:
    """A PNG of committed tokens over time, one line per request of a batch (``requests``: the objects of
    ``lynxkv run A B ... --json``), on the batch's clock (a request's own times plus its arrival): a flat stretch
    is a request waiting (for its anchor or its residual), a jump a verify that kept drafts. The residual's
    arrival is marked on each line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in requests:
        s, at = r["stats"], r["arrival_s"]
        times = [at + t for t in s["commit_times_s"]]
        line, = ax.step([at, *times], [0, *range(1, len(times) + 1)], where="post", linewidth=1.2,
                        label=r["name"] + (" (error)" if r["error"] else ""))
        if s["residual_ready_s"] is not None:
            t = at + s["residual_ready_s"]
            done = sum(1 for x in times if x <= t)
            ax.plot([t], [done], marker="D", color=line.get_color(), markersize=4, linestyle="none")
    ax.set_xlabel("seconds since the batch started (◆: the request's residual ready)")
    ax.set_ylabel("tokens committed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(requests) > 8 else 1, loc="upper left")
    return _png(fig, ax, title, dpi)
