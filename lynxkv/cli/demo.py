"""``lynxkv demo``: the whole pipeline on the embedded default (offline SmolLM2, a built-in prompt).

It runs the same commands a user would type, printing each one first: prefill + ``encode`` with the anchor and
the residual on two tiers (two directories standing for fast and slow storage), ``inspect``, ``verify
--against`` (reconstruction error, full and anchor-only), then ``run --compare`` under an emulated link whose
rate makes the residual take about ``--residual-steps`` decode steps, and ends with a short summary.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import typer

from lynxkv.cli.app import app
from lynxkv.cli.console import err, out


def _show(argv: list[str]) -> None:
    err.print(f"\n[bold cyan]$ lynxkv {' '.join(shlex.quote(a) for a in argv)}[/]")


@app.command()
def demo(
    directory: Path = typer.Option(Path("lynxkv-demo"), "--dir", help="Where the demo writes its tiers and files."),
    tokens: int = typer.Option(1000, min=16, help="Length of the built-in prompt, in tokens."),
    new_tokens: int = typer.Option(64, "--new-tokens", min=1, help="Tokens to generate."),
    residual_steps: float = typer.Option(40.0, min=1.0, help="Emulated link: residual transfer time in decode steps."),
) -> None:
    """Run the whole Lynx pipeline on the offline SmolLM2 and a built-in prompt."""
    import torch

    from lynxkv.api import encode_model, kv_error
    from lynxkv.cache import open_cache
    from lynxkv.cli.codec import inspect, verify
    from lynxkv.cli.run import run
    from lynxkv.hf.models import load_model, prefill
    from lynxkv.quant.scheme import DEFAULT
    from lynxkv.speculative.model_ops import measure_tpot
    from lynxkv.stream.units import format_rate
    from lynxkv.stream.units import format_bytes

    hot, cold = directory / "hot", directory / "cold"
    hot.mkdir(parents=True, exist_ok=True)
    cold.mkdir(parents=True, exist_ok=True)
    anchor, residual = hot / "demo.lynx", cold / "demo.lynxr"
    for stale in (anchor, residual):  # the demo's own outputs from an earlier run
        if stale.exists():
            os.unlink(stale)

    t0 = time.perf_counter()
    _show(["encode", "--model", "smollm2", "--tokens", str(tokens), "-o", str(anchor), "--residual", str(residual)])
    with err.status("loading SmolLM2 and prefilling the prompt ..."):
        info = encode_model(None, anchor, DEFAULT, tokens=tokens, residual=str(residual))
    err.print(f"prefill + encode: {time.perf_counter() - t0:.1f} s; anchor {format_bytes(info.anchor_bytes)} on the "
              f"fast tier ({hot}), residual {format_bytes(info.residual_bytes)} on the slow tier ({cold})")

    _show(["inspect", str(anchor)])
    inspect(cache=str(anchor), residual=None, json=False)

    # verify --against needs the original tensors: prefill again (cheap next to decoding) and compare in memory.
    _show(["verify", str(anchor)])
    try:
        verify(cache=str(anchor), residual=None, against=None, json=False)
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    loaded = load_model(None)
    with open_cache(anchor) as cache:
        ids = torch.tensor(cache.info.prompt_token_ids)
        original, _ = prefill(loaded.model, ids)
        errors = kv_error(cache.load_kv(dtype=torch.float32), cache.load_kv(anchor_only=True, dtype=torch.float32),
                          original)["mean"]
    out.print(
        "reconstruction error (vNMSE = Σ‖x̂−x‖²/Σ‖x‖², mean over layers): "
        f"full K {errors['key_full']:.2e} V {errors['value_full']:.2e}; "
        f"anchor only K {errors['key_anchor']:.2e} V {errors['value_anchor']:.2e}"
    )

    tpot = measure_tpot(loaded.model, original, len(ids))
    rate = info.residual_bytes / (residual_steps * tpot)
    err.print(f"\nTPOT {tpot * 1e3:.0f} ms at {len(ids)} tokens: an emulated link of {format_rate(rate)} makes the "
              f"residual take about {residual_steps:g} decode steps")
    bandwidth = f"{rate * 8:.0f}bps"
    _show(["run", str(anchor), "--bandwidth", bandwidth, "--max-new-tokens", str(new_tokens), "--ignore-eos",
           "--compare"])
    report = run(cache=str(anchor), model=None, max_new_tokens=new_tokens, temperature=0.0, top_p=1.0, seed=None,
                 bandwidth=bandwidth, latency=None, residual=None, max_window=64, verify_chunk=0,
                 residual_timeout=None, allow_anchor_only=False, ignore_eos=True, compare=True, as_json=False)

    s = report["stats"]
    rows = {r["method"]: r for r in report["compare"]["rows"]}
    n = max(k for k in (1, 32, 64) if k <= new_tokens)
    tt = {m: rows[m][f"tt{n}_s"] for m in ("lynx", "monolithic-full", "anchor-only")}
    same = rows["monolithic-full"]["same_tokens_as_lynx"]
    out.print(
        f"\n[bold]Summary[/]: the anchor ({info.bits_per_element['anchor']:.2f} bits/element) was ready at "
        f"{s['anchor_ready_s']:.2f} s and the residual at {s['residual_ready_s']:.2f} s; Lynx drafted {s['drafted']} "
        f"tokens on the anchor and kept {s['accepted']}. Time to {n} tokens: {tt['lynx']:.2f} s with Lynx, "
        f"{tt['monolithic-full']:.2f} s loading the full code first, {tt['anchor-only']:.2f} s on the lossy "
        f"anchor alone; the output is {'identical to' if same else 'DIFFERENT from'} decoding on the full code."
    )
