"""``lynxkv demo``: the whole pipeline on the embedded default (offline SmolLM2, a built-in prompt).

Each step is the library call behind a command a user would type, and the command is printed first: prefill +
``encode`` with the anchor and the residual on two tiers (two directories standing for fast and slow storage),
``inspect``, ``verify`` and the reconstruction error (full and anchor-only, against the prefill's own KV), then
``run --compare --repeats`` under an emulated link whose rate makes the residual take about ``--residual-steps``
decode steps (every method run ``--repeats`` times, interleaved, judged on medians), and a short summary.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import typer

from lynxkv.cli.app import app
from lynxkv.cli.console import err, escape, out, print_json, progress_step


def _show(argv: list[str]) -> None:
    err.print(f"\n[bold cyan]$ lynxkv {escape(' '.join(shlex.quote(a) for a in argv))}[/]")


@app.command()
def demo(
    directory: Path = typer.Option(Path("lynxkv-demo"), "--dir", help="Where the demo writes its tiers and files."),
    tokens: int = typer.Option(1000, "--tokens", min=16, help="Length of the built-in prompt, in tokens."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    residual_steps: float = typer.Option(40.0, "--residual-steps", min=1.0,
                                         help="Emulated link: residual transfer time in decode steps."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Run every method of the comparison this many "
                                "times, interleaved, and judge on the medians."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole report as JSON on stdout."),
) -> dict:
    """Run the whole Lynx pipeline on the offline SmolLM2 and a built-in prompt."""
    anchor, residual = _fresh_tiers(directory)
    loaded, ids, original, info = _encode(tokens, anchor, residual)
    # The residual lies outside the anchor's directory: the trust rule wants its place allowed.
    allow = [str(residual.parent)]
    described, errors = _inspect_and_verify(anchor, allow, original)
    tpot, rate = _choose_link(loaded, original, len(ids), info.residual_bytes, residual_steps)
    _show(["run", str(anchor), "--residual", str(residual), "--bandwidth", f"{rate * 8:.0f}bps", "-n",
           str(max_new_tokens), "--ignore-eos", "--compare"])
    result, compared = _run_and_compare(loaded, anchor, allow, rate, tpot, len(ids), max_new_tokens, repeats)
    report = {"inspect": described, "verify": {"ok": True, "findings": []}, "vnmse": errors,
              "tpot_s": tpot, "run_tpot_s": compared["judge"]["tpot_s"], "bandwidth_bytes_per_s": rate,
              "token_ids": result.token_ids,
              "text": loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True),
              "stats": result.stats.to_dict(), "compare": compared,
              "identical_to_full_code": _same_as_full(compared)}
    if as_json:
        print_json(report)
        return report
    _print_run(report, result.stats, info, rate, tpot, residual_steps, max_new_tokens, repeats)
    return report


def _fresh_tiers(directory: Path) -> tuple[Path, Path]:
    """The anchor's path on the fast tier and the residual's on the slow one (two directories under
    ``directory``), with the demo's own outputs of an earlier run removed."""
    hot, cold = directory / "hot", directory / "cold"
    hot.mkdir(parents=True, exist_ok=True)
    cold.mkdir(parents=True, exist_ok=True)
    anchor, residual = hot / "demo.lynx", cold / "demo.lynxr"
    for stale in (anchor, residual):
        if stale.exists():
            os.unlink(stale)
    return anchor, residual


def _encode(tokens: int, anchor: Path, residual: Path):
    """``lynxkv encode --model smollm2``: load the model, prefill the built-in prompt and save its cache on the two
    tiers. Returns the loaded model, the prompt's ids, the prefill's own KV and the cache's save info."""
    from lynxkv.cache import save_cache
    from lynxkv.hf import prefill
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.hf.choose import choose_scheme
    from lynxkv.stream.units import format_bytes

    t0 = time.perf_counter()
    _show(["encode", "--model", "smollm2", "--tokens", str(tokens), "-o", str(anchor), "--residual-out",
           str(residual)])
    with progress_step("loading SmolLM2"):
        loaded = load_model(None)
    ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, tokens))
    with progress_step(f"prefilling {len(ids)} tokens"):
        original, _ = prefill(loaded.model, ids)
    with progress_step("choosing the anchor and encoding"):
        choice = choose_scheme(loaded.model, ids, original)
        info = save_cache(anchor, original, choice.scheme, residual_path=str(residual), prompt_token_ids=ids.tolist(),
                          model_fingerprint=loaded.fingerprint)
    err.print(f"prefill + encode: {time.perf_counter() - t0:.1f} s; anchor {format_bytes(info.anchor_bytes)} on the "
              f"fast tier ({escape(str(anchor.parent))}), residual {format_bytes(info.residual_bytes)} on the slow "
              f"tier ({escape(str(residual.parent))})")
    return loaded, ids, original, info


def _inspect_and_verify(anchor: Path, allow: list[str], original) -> tuple[dict, dict]:
    """``lynxkv inspect`` and ``lynxkv verify`` (exit 1 on a finding), and the reconstruction error of the full code
    and of the anchor against the prefill's own KV. Returns the description and the errors."""
    import torch

    from lynxkv.cache import open_cache, verify_file
    from lynxkv.eval.metrics import kv_error

    _show(["inspect", str(anchor), "--allow-location", allow[0]])
    with open_cache(anchor, allow_locations=allow) as cache:
        described = cache.describe()
        errors = kv_error(cache.load_kv(dtype=torch.float32), cache.load_kv(anchor_only=True, dtype=torch.float32),
                          original)
    out.print(f"{described['layers']} layers × {described['kv_heads']} KV heads × {described['tokens']} tokens × "
              f"{described['head_dim']} ({described['dtype']}), {escape(described['scheme_description'])}: "
              f"{described['bits_per_element']['total']:.2f} bits/element "
              f"({described['bits_per_element']['anchor']:.2f} in the anchor)")

    _show(["verify", str(anchor), "--allow-location", allow[0]])
    findings = verify_file(anchor, allow_locations=allow)
    for f in findings:
        err.print(f"[red]FAIL[/] {escape(str(f))}")
    if findings:
        raise typer.Exit(1)
    err.print("[green]OK[/]: structure and checksums of both segments verified")
    m = errors["mean"]
    out.print(
        "reconstruction error (vNMSE = Σ‖x̂−x‖²/Σ‖x‖², mean over layers): "
        f"full K {m['key_full']:.2e} V {m['value_full']:.2e}; anchor only K {m['key_anchor']:.2e} V {m['value_anchor']:.2e}"
    )
    return described, errors


def _choose_link(loaded, original, prompt_len: int, residual_bytes: int, residual_steps: float) -> tuple[float, float]:
    """The decode step (timed after a warm-up) and the emulated link's rate in bytes/s that makes the residual take
    about ``residual_steps`` of those steps."""
    from lynxkv.speculative.model_ops import measure_tpot
    from lynxkv.stream.units import format_rate

    # A cold process's first forwards are several times slower than its later ones (thread pools, allocations):
    # warm up before timing the step the link is chosen by, and hand the step to the run's draft-or-wait rule
    measure_tpot(loaded.model, original, prompt_len, steps=3)
    tpot = measure_tpot(loaded.model, original, prompt_len, steps=8)
    rate = residual_bytes / (residual_steps * tpot)
    err.print(f"\nTPOT {tpot * 1e3:.0f} ms at {prompt_len} tokens: an emulated link of {format_rate(rate)} makes the "
              f"residual take about {residual_steps:g} decode steps")
    return tpot, rate


def _run_and_compare(loaded, anchor: Path, allow: list[str], rate: float, tpot: float, prompt_len: int,
                     max_new_tokens: int, repeats: int):
    """``lynxkv run --compare``: Lynx over the emulated link, then the monolithic baselines on the same link, every
    method ``repeats`` times, interleaved. Returns Lynx's first run and the comparison."""
    from lynxkv.bench.compare import compare_run
    from lynxkv.bench.emulated_link import link_at
    from lynxkv.speculative import RunConfig, Timing, run
    from lynxkv.stream.progressive import open_progressive

    cfg = RunConfig(max_new_tokens=max_new_tokens)
    timing = Timing(tpot, prompt_len)

    def open_load():
        return open_progressive(str(anchor), link=link_at(rate), allow_locations=allow)

    started = time.perf_counter()
    load = open_load()
    try:
        result = run(loaded.model, load, cfg, fingerprint=loaded.fingerprint, started_at=started, timing=timing)
        err.print(f"running the monolithic baselines (bf16, full code, anchor only) on the same link, every method "
                  f"{repeats} time(s) ...")
        compared = compare_run(loaded.model, load, result, cfg, loaded.fingerprint, bandwidth=rate,
                               repeats=repeats, open_load=open_load, timing=timing)
    finally:
        load.close()
    return result, compared


def _same_as_full(compared: dict) -> bool:
    """Whether Lynx's tokens and the monolithic full code's were the same in every run of the comparison."""
    rows = {r["method"]: r for r in compared["rows"]}
    return rows["monolithic-full"]["same_tokens_as_lynx"] and rows["lynx"]["same_tokens_as_lynx"]


def _print_run(report: dict, s, info, rate: float, tpot: float, residual_steps: float, max_new_tokens: int,
               repeats: int) -> None:
    """The run's text, its tables and the judge, the decode steps and the summary on stdout."""
    from lynxkv.cli.run import compare_table, print_judge, stats_table
    from lynxkv.stream.units import format_rate

    compared = report["compare"]
    rows = {r["method"]: r for r in compared["rows"]}
    run_step = report["run_tpot_s"]  # the monolithic full-code runs' own decode step (median)
    n = max(k for k in (1, 32, 64) if k <= max_new_tokens)
    tt = {name: rows[name][f"tt{n}_s"] for name in ("lynx", "monolithic-full", "anchor-only")}
    out.print(escape(report["text"]))
    out.print(stats_table(s, "gain, measured (TT64 monolithic full − lynx)", compared["judge"]["gain_measured_s"]))
    out.print(compare_table(compared, f"link {format_rate(rate)}"))
    print_judge(compared["judge"])
    kept = ", ".join(f"{r['accepted']} of {r['drafted']}" for r in rows["lynx"]["runs"])
    median = f" (medians of {repeats} runs)" if repeats > 1 else ""
    if run_step:
        out.print(f"decode step: {tpot * 1e3:.1f} ms timed before the run (the link's rate was chosen by it), "
                  f"{run_step * 1e3:.1f} ms in the runs: the residual took about "
                  f"{residual_steps * tpot / run_step:.0f} of the runs' steps")
    out.print(
        f"\n[bold]Summary[/]: the anchor ({info.bits_per_element['anchor']:.2f} bits/element) was ready at "
        f"{s.anchor_ready_s:.2f} s and the residual at {s.residual_ready_s:.2f} s; Lynx kept {kept} tokens drafted "
        f"on the anchor. Time to {n} tokens{median}: {tt['lynx']:.2f} s with Lynx, {tt['monolithic-full']:.2f} s "
        f"loading the full code first, {tt['anchor-only']:.2f} s on the lossy anchor alone; the output is "
        f"{'identical to' if report['identical_to_full_code'] else 'DIFFERENT from'} decoding on the full code."
    )
