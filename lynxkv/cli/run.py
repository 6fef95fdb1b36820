"""``lynxkv run``: decode from a .lynx cache, drafting on the anchor while the residual streams, then verifying."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from lynxkv.cli.app import app
from lynxkv.cli.codec import ALLOW_HELP
from lynxkv.cli.console import err, escape, out, print_json, read_text
from lynxkv.errors import InputError, LynxError
from lynxkv.storage.retry import within
from lynxkv.stream.units import format_seconds as _s


class _Printer:
    """Shows the text as it is committed. On a terminal, drafts appear dim and vanish when retracted (a rich
    Live view); elsewhere only committed text is written, as it is committed."""

    def __init__(self, tokenizer, live: bool):
        self.tok = tokenizer
        self.committed: list[int] = []
        self.provisional: list[int] = []
        self.shown = ""
        self.warned = False
        self.live = None
        if live:
            from rich.live import Live

            self.live = Live(console=out, auto_refresh=False, transient=False)
            self.live.start()

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def event(self, ev) -> None:
        if ev.kind == "draft":
            self.provisional.extend(ev.tokens)
        elif ev.kind == "retract":
            del self.provisional[len(self.provisional) - ev.count :]
        elif ev.kind == "commit":
            del self.provisional[: ev.confirmed]
            self.committed.extend(ev.tokens)
            if not ev.verified and not self.warned:
                self.warned = True
                err.print("[bold yellow]warning:[/] the residual did not arrive; the text below is UNVERIFIED "
                          "anchor-only output (lossy)")
        else:
            return
        if self.live is not None:
            from rich.text import Text

            done = self._text(self.committed)
            view = Text(done)
            view.append(self._text(self.committed + self.provisional)[len(done):], style="dim")
            self.view = view
            self.live.update(view, refresh=True)
        elif ev.kind == "commit":
            text = self._text(self.committed)
            if not text.endswith("\ufffd") and text.startswith(self.shown):
                out.print(text[len(self.shown):], end="")
                out.file.flush()
                self.shown = text

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
        else:
            text = self._text(self.committed)
            if text.startswith(self.shown):
                out.print(text[len(self.shown):], end="")
        out.print()


def stats_table(stats, gain_label: str, gain: float | None):
    from rich.table import Table

    t = Table(title="lynx run", show_header=False, title_justify="left")
    t.add_column(no_wrap=True)
    t.add_column()
    acc = stats.acceptance_rate
    rows = [
        ("anchor ready", _s(stats.anchor_ready_s)),
        ("residual ready", _s(stats.residual_ready_s)),
        ("first draft token", _s(stats.first_draft_s)),
        ("first committed token", _s(stats.first_commit_s)),
        ("TT1 / TT32 / TT64 committed", " / ".join(_s(stats.tt(n)) for n in (1, 32, 64))),
        ("drafted / accepted", f"{stats.drafted} / {stats.accepted}"),
        ("acceptance rate", "-" if acc is None else f"{acc:.2f}"),
        ("window (planned / cap)", f"{stats.window_planned if stats.window_planned is not None else '-'} / {stats.window_cap}"),
        ("draft step / verify (passes) / TPOT", f"{_s(stats.draft_step_s, 'ms')} / {_s(stats.verify_s, 'ms')} "
         f"({stats.verify_passes}) / {_s(stats.tpot_s, 'ms')}"),
        ("Δ theoretical = min(t_res, 64·TPOT)", _s(stats.gain_theoretical(64))),
        (gain_label, _s(gain)),
    ]
    if stats.waited_on_eta:
        rows.append(("window", "stopped drafting: residual due within a fraction of a step"))
    if stats.drafting_disabled:
        rows.append(("drafting disabled", stats.drafting_disabled))
    if stats.branch_at is not None:
        kept = "not verified" if stats.branch_accepted is None else f"{stats.branch_accepted} kept"
        rows.append(("branch (fork at draft / drafts)", f"{stats.branch_at} / {len(stats.branch_token_ids) - 1}, "
                     f"{kept}"))
    rows.append(("verified", "yes" if stats.verified else f"NO (anchor-only: {stats.residual_error})"))
    for k, v in rows:
        t.add_row(k, v)
    return t


def compare_table(compare: dict, link_text: str):
    from rich.table import Table

    repeats = compare["repeats"]
    how = f"medians of {repeats} interleaved runs" if repeats > 1 else "one run each"
    t = Table(title=f"TT-N side by side ({link_text}; {how}; monolithic transfers computed as bytes/bandwidth, "
              "then waited)", title_justify="left")
    cols = ["method", "data ready", "TT1", "TT32", "TT64", "= lynx"]
    if repeats > 1:
        cols += ["TT64 per run", "drafts kept per run"]
    for col in cols:
        t.add_column(col, no_wrap=True)
    for r in compare["rows"]:
        name = r["method"] + ("" if r["verified"] else " (lossy)")
        cells = [name, _s(r["ready_s"]), _s(r["tt1_s"]), _s(r["tt32_s"]), _s(r["tt64_s"]),
                 "yes" if r["same_tokens_as_lynx"] else "no"]
        if repeats > 1:
            cells.append(" ".join(_s(run["tt64_s"]) for run in r["runs"]))
            cells.append(" ".join(f"{run['accepted']}/{run['drafted']}" for run in r["runs"])
                         if r["method"] == "lynx" else "")
        t.add_row(*cells)
    return t


def _warm_up(model, tokens: int, cfg):
    """Before the load opens: a :class:`~lynxkv.speculative.Timing` with one decode step measured at ``tokens``
    cached tokens after a warm-up step (the draft-or-wait rule needs it before the first draft, and the warm-up keeps
    the model's first-call initialisation off the run), or, where no rule needs a step, after a 4-token forward."""
    import torch

    from lynxkv.speculative import Timing

    timing = Timing()
    if cfg.max_window and cfg.speculate:
        try:
            if timing.calibrate(model, tokens) is not None:
                return timing
        except Exception:  # noqa: BLE001 - only an estimate: without it the run drafts, and meets any error itself
            pass
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=model.device))
    return timing


@app.command()
def run(
    caches: list[str] = typer.Argument(..., metavar="CACHE...", help="The cache: path or URL of the anchor file (http://HOST:PORT/NAME for lynxkv serve, lmcache://MODEL?anchor_path=DIR&tokens=IDS for an LMCache store). Several caches, or one .jsonl request file, are decoded together in one batch over one link."),
    model: str = typer.Option(None, "--model", help="Model name, path or .gguf (default: the offline SmolLM2)."),
    dtype: str = typer.Option("fp32", "--dtype", help="The model's compute dtype: fp32, bf16 or fp16 (the "
                              "cache is converted to it, whatever dtype it stores)."),
    device: str = typer.Option("cpu", "--device", help="Where the model, its caches and every step run: cpu, "
                               "cuda, cuda:1 ... (only the cache's page records cross to it; they are decoded "
                               "there)."),
    prompt: str = typer.Option(None, "--prompt", help="New text after the cached prompt (or a whole prompt that "
                               "starts with it): a question about a cached document. @FILE reads it from FILE."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (with --temperature > 0)."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed (runs with the same seed are identical)."),
    bandwidth: str = typer.Option(None, "--bandwidth", help="Emulated link rate for both streams, e.g. 200Mbps."),
    residual: str = typer.Option(None, "--residual", help="Read the residual from here (path, URL)."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    exact: bool = typer.Option(False, "--exact", help="Verify the drafts against the original tensors (the exact "
                               "segment): the output is greedy decoding on the original cache."),
    max_window: int = typer.Option(64, "--max-window", min=0, help="Cap on drafted tokens (0: no drafting)."),
    anchor_timeout: float = typer.Option(None, "--anchor-timeout", help="Give up (one error line) if the whole "
                                         "anchor is not in this many seconds after its transfer starts; a "
                                         "publishing prefill's own time counts. Default: the transport's retries "
                                         "decide."),
    residual_timeout: float = typer.Option(None, "--residual-timeout", help="Give up on the residual after this "
                                           "many seconds from the start."),
    allow_anchor_only: bool = typer.Option(False, "--allow-anchor-only", help="If the residual never arrives, "
                                           "finish on the anchor and flag the output as unverified."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop at the end-of-sequence token."),
    compare: bool = typer.Option(False, "--compare", help="Also run the monolithic baselines on the same link."),
    timeline: Path = typer.Option(None, "--timeline", help="Draw the run's timeline (with --compare: one row per "
                                  "method) to this PNG file; --json carries the same data under timelines."),
    as_json: bool = typer.Option(False, "--json", help="Print token_ids, text and stats as JSON on stdout."),
    max_batch: int = typer.Option(None, "--max-batch", min=1, help="Several caches: at most this many requests "
                                  "open at once (the next is admitted when one leaves)."),
) -> dict:
    """Decode from CACHE with Lynx: draft on the anchor while the residual arrives, verify, continue."""

    from lynxkv.cli import run_batch as many
    from lynxkv.cli.console import parse_dtype
    from lynxkv.speculative import RunConfig, SamplingParams
    from lynxkv.stream.units import parse_bandwidth

    from lynxkv.cache.kv import resolve_device

    torch_dtype = parse_dtype(dtype)
    try:  # a device that is not there: refused before any model loads
        where = resolve_device(device)
    except InputError as exc:  # ("device: ...": named as the option)
        raise InputError(f"--{exc}") from None
    for flag, value in (("--anchor-timeout", anchor_timeout), ("--residual-timeout", residual_timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InputError(f"{flag}: expected a positive number of seconds, got {value}")
    allow = tuple(allow_location or ())
    if len(caches) > 1 or many.is_request_file(caches):
        unsupported = {"--residual": residual, "--exact": exact}
        named = [k for k, v in unsupported.items() if v]
        if named:
            raise InputError(f"{', '.join(named)}: one cache at a time (not with several caches)")
        if timeline is not None:
            _check_timeline_path(timeline)
        specs = (many.read_requests(caches[0]) if many.is_request_file(caches)
                 else [many.Spec(cache=c, name=f"{i}:{Path(c).name}") for i, c in enumerate(caches)])
        cfg = RunConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature, top_p=top_p),
                        seed=seed, max_window=max_window, anchor_timeout=anchor_timeout,
                        residual_timeout=residual_timeout, allow_anchor_only=allow_anchor_only)
        return many.run_many(specs, model=model, torch_dtype=torch_dtype, dtype_name=dtype, device=where, cfg=cfg,
                             rate=parse_bandwidth(bandwidth), max_batch=max_batch, compare=compare,
                             as_json=as_json, timeline=timeline, prompt=_prompt_text(prompt),
                             ignore_eos=ignore_eos, allow_locations=allow)
    cache = caches[0]
    prompt = _prompt_text(prompt)
    if timeline is not None:
        _check_timeline_path(timeline)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    rate = parse_bandwidth(bandwidth)
    cfg = RunConfig(  # checked here, before any model loads; the stop token is the tokenizer's, added once it is in
        max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, max_window=max_window,
        anchor_timeout=anchor_timeout, residual_timeout=residual_timeout, allow_anchor_only=allow_anchor_only)
    return _run_one(cache, cfg, model=model, dtype=dtype, torch_dtype=torch_dtype, device=where, prompt=prompt,
                    residual=residual,
                    allow=allow, exact=exact, allow_anchor_only=allow_anchor_only, rate=rate,
                    max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, compare=compare, timeline=timeline,
                    as_json=as_json)


def _run_one(cache: str, cfg, *, model, dtype: str, torch_dtype, device, prompt, residual, allow, exact: bool,
             allow_anchor_only: bool, rate, max_new_tokens: int, ignore_eos: bool, compare: bool, timeline,
             as_json: bool) -> dict:
    """One cache: check it names this model, load the model, time a step, decode, report."""
    from lynxkv.bench.compare import compare_run
    from lynxkv.bench.emulated_link import link_at
    from lynxkv.bench.timeline import compare_timelines, run_timeline
    from lynxkv.cli.console import model_label, progress_step
    from lynxkv.hf.models import check_context, load_model
    from lynxkv.integrations.lmcache import source as lmcache_source
    from lynxkv.speculative import stream
    from lynxkv.stream.exact_load import ExactLoad
    from lynxkv.stream.progressive import open_progressive

    store = lmcache_source.parse_address(cache) if lmcache_source.is_lmcache_source(cache) else None
    if exact and (store is not None or compare or allow_anchor_only):
        raise InputError("--exact needs a .lynx cache with an exact segment and excludes --compare and "
                         "--allow-anchor-only")
    model, cached = within(cfg.anchor_timeout, lambda: _model_of(cache, store, model, prompt=prompt,
                                                                 residual=residual, allow=allow, exact=exact),
                           "the anchor")
    with progress_step(f"loading model {model_label(model)} ({dtype}, {device})"):
        loaded = load_model(model, dtype=torch_dtype, device=device)
        new_tokens = len(loaded.tokenizer.encode(prompt)) if prompt else 0
        timing = _warm_up(loaded.model, len(store.tokens) if store is not None else cached + new_tokens, cfg)
    # LMCache keys identify a model by name only (checked above): its chunks record the name's fingerprint
    fingerprint = lmcache_source.name_fingerprint(store.model) if store is not None else loaded.fingerprint
    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    cfg = replace(cfg, stop_token_ids=() if ignore_eos or eos is None else (int(eos),))

    # Room after the cached tokens for what the run appends (new prompt tokens, drafts, decoded tokens): the runner's
    # caches grow into it in place instead of copying the whole cache at their first step (a longer run copies once)
    room = max_new_tokens + 1 + (new_tokens + 32 if prompt else 0)

    def open_load():
        load = open_progressive(cache, residual=residual, link=link_at(rate),
                                allow_anchor_only=allow_anchor_only, exact=exact,
                                allow_locations=allow, room=room, device=device)
        # the exact stage streams behind the residual in the same load (anchor -> full code -> exact)
        return ExactLoad(load, load.exact.result) if exact else load

    started = time.perf_counter()
    load = open_load()
    printer = None
    try:
        new, cached = _new_tokens(load, loaded.tokenizer, prompt, store, cached, cfg.anchor_timeout)
        check_context(loaded.model.config, cached + len(new or []), max_new_tokens)
        printer = None if as_json else _Printer(loaded.tokenizer, live=out.is_terminal)
        events = stream(loaded.model, load, cfg, new_token_ids=new, timing=timing, fingerprint=fingerprint,
                        provisional=printer is not None and printer.live is not None, started_at=started)
        result = _collect(events, printer)
        printer, stats = None, result.stats
        report = _run_report(load, new, result, loaded.tokenizer, exact)
        gain_label, gain = "gain, estimated (vs. wait-then-decode at this TPOT)", stats.gain_estimated(64)
        if compare:
            err.print("running the monolithic baselines (bf16, full code, anchor only) on the same link ...")
            cmp = compare_run(loaded.model, load, result, cfg, fingerprint, bandwidth=rate,
                              new_token_ids=new, open_load=open_load, timing=timing)
            report["compare"] = cmp
            gain_label, gain = "gain, measured (TT64 monolithic full − lynx)", cmp["judge"]["gain_measured_s"]
        report["timelines"] = compare_timelines(report["compare"]) if compare else [run_timeline(stats)]
    finally:
        if printer is not None:
            printer.close()
        load.close()

    _print_report(report, stats, gain_label, gain, as_json)  # the results first: a --timeline that cannot be
    if timeline is not None:  # written loses none of them
        write_timeline(timeline, report["timelines"], cache)
    return report


def _new_tokens(load, tokenizer, prompt, store, cached: int, timeout: float | None) -> tuple[list[int] | None, int]:
    """(the tokens prefilled on the anchor after the cached prompt, the cached prompt's length): ``--prompt``'s
    continuation, or an LMCache store's tokens past its stored prefix; both need the anchor header's prompt ids
    (waited for up to ``timeout`` seconds)."""
    from lynxkv.hf import continuation_ids

    if prompt is None and store is None:
        return None, cached
    try:
        load.wait_anchor(timeout)
    except TimeoutError:
        raise LynxError(f"the anchor did not arrive within {timeout:g} s") from None
    if prompt is not None:
        return continuation_ids(tokenizer, [int(t) for t in load.prompt_token_ids or []], prompt), cached
    return list(store.tokens[len(load.prompt_token_ids or []):]) or None, len(load.prompt_token_ids or [])


def _run_report(load, new: list[int] | None, result, tokenizer, exact: bool) -> dict:
    """The run's report: the prompt's and the output's ids, the text, whether and against what it was verified, the
    stats."""
    tokens, stats = result.token_ids, result.stats
    return {
        "prompt_token_ids": [int(t) for t in load.prompt_token_ids or []] + (new or []),
        "token_ids": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "verified": stats.verified,
        "verified_against": "exact" if exact else "full code",
        "stats": stats.to_dict(),
    }


def _model_of(cache: str, store, model, *, prompt, residual, allow, exact: bool) -> tuple:
    """(the model to load, the cached prompt's length) for ``cache``: the one it records, checked against the one
    the user named before any weights load (an LMCache store: the one its address names)."""
    from lynxkv.cache import open_cache
    from lynxkv.hf.models import model_for_cache, model_id
    from lynxkv.integrations.lmcache import source as lmcache_source

    if store is not None:  # an LMCache store knows its model by name: the one its keys were made for
        if prompt is not None:
            raise InputError("an lmcache:// source continues its tokens=; put the whole prompt's ids there")
        # (its tokens= are the prompt: the ones after the stored prefix come as new text)
        return model_for_cache({lmcache_source.MODEL_PROPERTY: model_id(store.model)}, model or store.model), 0
    with open_cache(cache, residual=residual, allow_locations=allow) as c:
        model = model_for_cache(c.info.properties, model)
        if exact and not c.info.has_exact:
            raise InputError(f"{cache}: this cache has no exact segment (encode it with --exact)")
        return model, len(c.info.prompt_token_ids or [])


def _collect(events, printer):
    """The run's committed tokens and stats from its events, shown by ``printer`` (if any) as they come."""
    from lynxkv.speculative import RunResult

    tokens: list[int] = []
    stats = None
    for ev in events:
        if printer is not None:
            printer.event(ev)
        if ev.kind == "commit":
            tokens.extend(ev.tokens)
        elif ev.kind == "done":
            stats = ev.stats
    if printer is not None:
        printer.close()
    return RunResult(tokens, stats)


def _print_report(report: dict, stats, gain_label: str, gain, as_json: bool) -> None:
    from lynxkv.stream.units import format_rate

    if as_json:
        print_json(report)
        return
    out.print(stats_table(stats, gain_label, gain))
    if "compare" in report:
        link_text = f"link {format_rate(report['compare']['link']['bandwidth_bytes_per_s'])}"
        out.print(compare_table(report["compare"], link_text))
        print_judge(report["compare"]["judge"])


def _prompt_text(prompt: str | None) -> str | None:
    """``--prompt``: the text itself, or ``@FILE`` for the text of FILE."""
    if prompt is None or not prompt.startswith("@"):
        return prompt
    return read_text(Path(prompt[1:]))


def _check_timeline_path(path: Path) -> None:
    """Refuse a --timeline target that cannot be written, before any model is loaded."""
    if path.suffix.lower() != ".png":
        raise InputError(f"--timeline: {path}: expected a .png file name")
    if not path.parent.is_dir():
        raise InputError(f"--timeline: {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise InputError(f"--timeline: {path} is a directory")


def write_timeline(path: Path, timelines: list[dict], cache: str) -> None:
    """Draw ``timelines`` into the PNG ``path``, atomically (a partial picture is never visible)."""
    from lynxkv.bench.timeline import render_png
    from lynxkv.storage import write_atomic

    write_atomic(path, render_png(timelines, title=f"lynxkv run {Path(cache).name}"))
    err.print(f"timeline written to {escape(str(path))}")


def print_judge(j: dict) -> None:
    """What TT64 measured against the monolithic full code and the anchor alone, in one line (medians when
    repeated, with each round's gain)."""
    if j["gain_measured_s"] is None:
        return
    medians = ""
    if j["repeats"] > 1:
        rounds = " ".join(f"{r['gain_over_delta']:.2f}" for r in j["rounds"] if r["gain_over_delta"] is not None)
        medians = f"; medians of {j['repeats']} runs (gain per round, in Δ: {rounds})"
    gain = "" if j["gain_over_delta"] is None else f" = {j['gain_over_delta']:.2f} Δ"
    ratio = "" if j["ratio_to_anchor_only"] is None else f", {j['ratio_to_anchor_only']:.2f}×"
    out.print(
        f"TT64: lynx {_s(j['tt_lynx_s'])} vs monolithic full {_s(j['tt_full_s'])} (gain {_s(j['gain_measured_s'])}"
        f"{gain}, Δ = {_s(j['delta_theoretical_s'])}); vs anchor-only {_s(j['tt_anchor_only_s'])}{ratio}" + medians
    )
