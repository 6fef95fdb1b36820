"""``lynxkv run a.lynx b.lynx ...`` or ``lynxkv run requests.jsonl``: many requests decoded together over one link.

A request file has one JSON object per line: ``{"cache": "a.lynx"}`` and optionally ``"prompt"`` (new text after
the cached prompt), ``"max_new_tokens"``, ``"temperature"``, ``"top_p"``, ``"seed"``, ``"arrival_s"`` (seconds
after the start) and ``"name"``; a relative cache path is relative to the file's folder. Options given on the
command line are every request's defaults.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from lynxkv.cache.loading import CacheLoad
from lynxkv.cli.console import err, escape, out, read_text
from lynxkv.errors import InputError
from lynxkv.stream.units import format_seconds as _s

# Several caches share one emulated link, one whole cache at a time, smallest first (shortest residual first: the
# lowest mean time to N tokens; docs/results.md)
LINK_ORDER = "srf"
_KEYS = {"cache", "prompt", "max_new_tokens", "temperature", "top_p", "seed", "arrival_s", "name"}


@dataclass
class Spec:
    cache: str
    name: str
    prompt: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    arrival_s: float = 0.0


def is_request_file(args: list[str]) -> bool:
    return len(args) == 1 and args[0].endswith(".jsonl")


def read_requests(path: str) -> list[Spec]:
    """The requests of a JSONL file, each checked; one clear error naming the line otherwise. A key whose value
    is ``null`` takes the command's default."""
    base = Path(path).parent
    specs, names = [], set()
    types = {"prompt": str, "max_new_tokens": int, "temperature": (int, float), "top_p": (int, float),
             "seed": int, "arrival_s": (int, float), "name": str}
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("cache"), str) or not obj["cache"]:
            raise InputError(f'{where}: expected an object with a "cache" path')
        unknown = set(obj) - _KEYS
        if unknown:
            raise InputError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(_KEYS))})")
        obj = {k: v for k, v in obj.items() if v is not None}
        for key, kind in types.items():
            if key in obj and (not isinstance(obj[key], kind) or isinstance(obj[key], bool)):
                raise InputError(f"{where}: {key!r} has the wrong type ({type(obj[key]).__name__})")
        for key in ("cache", "prompt", "name"):
            if key in obj and not _is_text(obj[key]):
                raise InputError(f"{where}: {key!r} is not valid text (a NUL or an unpaired surrogate)")
        for key in ("temperature", "top_p", "arrival_s"):
            if key in obj and not math.isfinite(obj[key]):
                raise InputError(f"{where}: {key!r} must be a finite number, got {obj[key]}")
        if obj.get("max_new_tokens", 1) < 1 or obj.get("arrival_s", 0) < 0:
            raise InputError(f"{where}: max_new_tokens must be >= 1 and arrival_s >= 0")
        cache = obj["cache"]
        if "://" not in cache and not os.path.isabs(cache):
            cache = str(base / cache)
        name = obj.get("name") or f"{len(specs)}:{Path(cache).name}"
        if name in names:
            raise InputError(f"{where}: a request named {name!r} is already in the file (names are the requests' "
                             "keys in the output)")
        names.add(name)
        specs.append(Spec(cache=cache, name=name, **{k: obj[k] for k in ("prompt", "max_new_tokens", "temperature",
                                                                       "top_p", "seed", "arrival_s") if k in obj}))
    if not specs:
        raise InputError(f"{path}: no requests")
    return specs


def _is_text(value: str) -> bool:
    """Whether ``value`` can be printed and written as UTF-8, and used as a path (no NUL)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def run_many(specs: list[Spec], *, model, torch_dtype, dtype_name: str, device, cfg, rate, max_batch: int | None,
             compare: bool, as_json: bool, timeline: Path | None, prompt: str | None, ignore_eos: bool,
             allow_locations: tuple = ()) -> dict:
    """Decode every request together (lynxkv.speculative.engine) and report one row per request and the aggregate."""
    import torch

    from lynxkv.cli.console import model_label, print_json, progress_step
    from lynxkv.hf import continuation_ids
    from lynxkv.hf.models import check_context, load_model

    configs = []  # each request's settings with the command's, checked first
    for spec in specs:
        try:
            configs.append(_config(cfg, spec))
        except InputError as exc:
            raise InputError(f"request {spec.name}: {exc}") from None
    sizes, errors = _check_caches(specs, model, allow_locations, cfg.anchor_timeout)
    if len(errors) == len(specs):
        _report_errors([(spec.name, errors[i]) for i, spec in enumerate(specs)])
        raise SystemExit(1)
    with progress_step(f"loading model {model_label(model)} ({dtype_name}, {device})"):
        loaded = load_model(model, dtype=torch_dtype, device=device)
        with torch.no_grad():
            loaded.model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=loaded.model.device))
    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    stops = () if ignore_eos or eos is None else (int(eos),)
    requests = []
    for i, (spec, config, (_, _, ids)) in enumerate(zip(specs, configs, sizes)):
        text = spec.prompt if spec.prompt is not None else prompt
        config, new = replace(config, stop_token_ids=stops), None
        if i not in errors:
            try:
                new = continuation_ids(loaded.tokenizer, ids, text) if text is not None and ids else None
                check_context(loaded.model.config, len(ids) + len(new or []), config.max_new_tokens)
            except InputError as exc:
                errors[i] = str(exc)
        requests.append((spec, config, new, errors.get(i)))

    lynx = _run_once(loaded, requests, sizes, rate, max_batch, cfg.allow_anchor_only, speculate=True,
                     progress=not as_json, allow_locations=allow_locations)
    report = {"requests": [_request_report(loaded, r, spec, ids + (new or []))
                           for r, (spec, _, new, _), (_, _, ids) in zip(lynx.requests, requests, sizes)],
              "aggregate": {**lynx.aggregate(), "link_order": LINK_ORDER, "link_turn": "cache",
                            "link": _link_text(rate),
                            "residuals_sent_in_order": lynx.link_order}}
    if compare:
        err.print("running the monolithic full code on the same link, batched the same way ...")
        mono = _run_once(loaded, requests, sizes, rate, max_batch, False, speculate=False, progress=False,
                         allow_locations=allow_locations)
        _add_compare(report, mono)
    if as_json:  # the results first: a --timeline that cannot be written loses none of them
        print_json(report)
    else:
        out.print(batch_table(report, compare))
    failed = [(r["name"], r["error"]) for r in report["requests"] if r["error"]]
    _report_errors(failed)
    if timeline is not None:
        from lynxkv.bench.timeline import render_batch_png
        from lynxkv.storage import write_atomic

        write_atomic(timeline, render_batch_png(report["requests"], title=f"lynxkv run: {len(specs)} requests"))
        err.print(f"tokens over time written to {escape(str(timeline))}")
    if failed:
        raise SystemExit(1)  # every other request's output is above
    return report


def _check_caches(specs: list[Spec], model, allow_locations: tuple,
                  timeout: float | None) -> tuple[list[tuple], dict[int, str]]:
    """Every cache's recorded model checked against ``model`` before any weights load, each header waited for up to
    ``timeout`` seconds: (per request its anchor's and residual's bytes and its cached prompt's ids, the requests
    that cannot run: index -> why)."""
    from lynxkv.cache import open_cache
    from lynxkv.errors import LynxError
    from lynxkv.hf.models import model_for_cache
    from lynxkv.storage.retry import within

    def check(cache: str) -> tuple:
        with open_cache(cache, allow_locations=allow_locations) as c:
            model_for_cache(c.info.properties, model)
            return c.info.anchor_bytes, c.info.residual_bytes, list(c.info.prompt_token_ids or [])

    sizes, errors = [], {}  # a request that cannot run ends with its error, the others go on
    for i, spec in enumerate(specs):
        try:
            sizes.append(within(timeout, lambda cache=spec.cache: check(cache), "the anchor"))
        except LynxError as exc:
            errors[i] = f"{spec.cache}: {exc}" if spec.cache not in str(exc) else str(exc)
            sizes.append((0, 0, []))
    return sizes, errors


def _add_compare(report: dict, mono) -> None:
    """Each request's monolithic full-code run (``mono``, batched the same way) beside its Lynx row, and the
    monolithic aggregate."""
    for row, m in zip(report["requests"], mono.requests):
        tt_l, tt_m = row["stats"]["tt64_s"], m.stats.tt(64)
        same = None if m.error or row["error"] else m.token_ids == row["token_ids"]  # nothing to compare
        row["compare"] = {"monolithic_full": {"tt1_s": m.stats.tt(1), "tt64_s": tt_m, "error": m.error,
                                              "same_tokens_as_lynx": same},
                          "gain_tt64_s": None if tt_l is None or tt_m is None else tt_m - tt_l}
    report["aggregate"]["monolithic_full"] = mono.aggregate()


def _report_errors(failed: list[tuple[str, str]]) -> None:
    """One line per request that failed, its name and its error as plain text (never markup)."""
    for name, error in failed:
        err.print(f"[bold red]lynxkv: error:[/] request {escape(name)}: {escape(error)}", highlight=False,
                  soft_wrap=True)


def _config(cfg, spec: Spec):
    from lynxkv.speculative import SamplingParams

    sampling = SamplingParams(
        temperature=cfg.sampling.temperature if spec.temperature is None else float(spec.temperature),
        top_p=cfg.sampling.top_p if spec.top_p is None else float(spec.top_p))
    return replace(cfg, sampling=sampling, seed=cfg.seed if spec.seed is None else spec.seed,
                   max_new_tokens=spec.max_new_tokens or cfg.max_new_tokens)


def _run_once(loaded, requests, sizes, rate, max_batch, allow_anchor_only, *, speculate, progress,
              allow_locations: tuple = ()):
    from lynxkv.speculative import BatchRequest, run_batch
    from lynxkv.bench.link_queue import LinkQueue
    from lynxkv.stream.progressive import open_progressive

    queue = LinkQueue(rate, policy=LINK_ORDER) if rate is not None else None
    device = loaded.model.device  # every cache decoded where the model is

    def opener(index, spec, anchor_bytes, residual_bytes, error):
        if error is not None:  # it ends with its error as it opens; it takes no turn on the link
            def refuse():
                raise InputError(error)
            return refuse
        lane = None
        if queue is not None:
            # each cache whole (its anchor first), one after another: every request is verified as early as its
            # monolithic full code would arrive (docs/results.md, the link's turn)
            lane = queue.lane(anchor_bytes + residual_bytes, spec.name)
            if spec.arrival_s == 0 and (max_batch is None or index < max_batch):
                lane.join()  # opened in the batch's first pass: waiting from the start, not from when its turn came

        def open_load():
            if lane is None:
                return open_progressive(spec.cache, allow_anchor_only=allow_anchor_only,
                                        allow_locations=allow_locations, device=device)
            lane.join()
            try:
                load = open_progressive(spec.cache, link=lane, allow_anchor_only=allow_anchor_only,
                                        allow_locations=allow_locations, device=device)
            except BaseException:
                lane.release()
                raise
            load.residual.add_done_callback(lambda _: lane.release())
            return _LaneLoad(load, lane)
        return open_load

    batch = [BatchRequest(opener(i, spec, a, r, error),
                          replace(c, speculate=speculate, allow_anchor_only=allow_anchor_only),
                          new_token_ids=new, arrival_s=spec.arrival_s, name=spec.name)
             for i, ((spec, c, new, error), (a, r, _)) in enumerate(zip(requests, sizes))]
    with _Progress(requests, enabled=progress and err.is_terminal) as bar:
        result = run_batch(loaded.model, batch, fingerprint=loaded.fingerprint, max_batch=max_batch,
                           on_step=bar.update)
    result.link_order = list(queue.order) if queue is not None else []
    return result


class _LaneLoad(CacheLoad):
    """A load that gives its lane's turn up when it is closed, whatever state its residual is in (everything else
    is the load's own). It holds the load, not the other way round: a request that lets it go frees both at once."""

    def __init__(self, load, lane):
        self._load, self._lane = load, lane
        self.prompt_token_ids, self.model_fingerprint = load.prompt_token_ids, load.model_fingerprint
        self.grow_in_place, self.streams_layers = load.grow_in_place, load.streams_layers

    def wait_anchor(self, timeout=None):
        kv = self._load.wait_anchor(timeout)
        self.prompt_token_ids, self.model_fingerprint = self._load.prompt_token_ids, self._load.model_fingerprint
        return kv

    @property
    def residual(self):
        return self._load.residual

    def residual_eta(self):
        return self._load.residual_eta()

    @property
    def timeline(self):
        return self._load.timeline

    def layer_in(self, layer, timeout=None):
        return self._load.layer_in(layer, timeout)

    def full_layer(self, layer):
        return self._load.full_layer(layer)

    def layers_given_up(self):
        self._load.layers_given_up()

    def residual_in(self):
        return self._load.residual_in()

    def dequantize_landed(self):
        return self._load.dequantize_landed()

    def hold_early(self, on):
        self._load.hold_early(on)

    def close(self) -> None:
        try:
            self._load.close()
        finally:
            self._lane.release()


class _Progress:
    """One bar per request on stderr (tokens committed of max_new_tokens), on a terminal only."""

    def __init__(self, requests, enabled: bool):
        self.requests, self.enabled, self.bars = requests, enabled, None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=err,
                                 transient=True)
            self.bars.start()
            self.tasks = [self.bars.add_task(escape(spec.name), total=c.max_new_tokens)
                          for spec, c, _, _ in self.requests]
        return self

    def update(self, results) -> None:
        if self.bars is not None:
            for task, r in zip(self.tasks, results):
                self.bars.update(task, completed=len(r.token_ids))

    def __exit__(self, *exc):
        if self.bars is not None:
            self.bars.stop()


def _request_report(loaded, r, spec: Spec, prompt_ids: list[int]) -> dict:
    """One request's object: what ``lynxkv run --json`` prints for one cache, plus its name, arrival and error."""
    return {
        "name": r.name,
        "cache": spec.cache,
        "arrival_s": spec.arrival_s,
        "error": r.error,
        "prompt_token_ids": prompt_ids,
        "token_ids": r.token_ids,
        "text": loaded.tokenizer.decode(r.token_ids, skip_special_tokens=True),
        "verified": r.verified,
        "verified_against": "full code",
        "stats": r.stats.to_dict(),
    }


def _link_text(rate) -> str:
    from lynxkv.stream.units import format_rate

    return "no link emulation" if rate is None else format_rate(rate)


def batch_table(report: dict, compare: bool):
    from rich.table import Table

    agg = report["aggregate"]
    t = Table(title=f"lynx run: {agg['requests']} requests, one link ({agg['link']}; one cache at a time, smallest "
                    "first)", title_justify="left")
    cols = ["request", "prompt", "arrival", "anchor", "residual", "TT1", "TT64", "tokens", "drafted / kept",
            "verify", "verified"]
    if compare:
        cols += ["TT64 monolithic", "gain", "= lynx"]
    for c in cols:
        t.add_column(c, no_wrap=True)
    for r in report["requests"]:
        s = r["stats"]
        cells = [escape(r["name"]), str(s["prompt_tokens"]), _s(r["arrival_s"]), _s(s["anchor_ready_s"]),
                 _s(s["residual_ready_s"]), _s(s["tt1_s"]), _s(s["tt64_s"]), str(s["committed"]),
                 f"{s['drafted']} / {s['accepted']}", _s(s["verify_s"], "ms"),
                 "ERROR" if r["error"] else ("yes" if r["verified"] else "NO (anchor only)")]
        if compare:
            c = r["compare"]
            cells += [_s(c["monolithic_full"]["tt64_s"]), _s(c["gain_tt64_s"]),
                      {True: "yes", False: "no", None: "-"}[c["monolithic_full"]["same_tokens_as_lynx"]]]
        t.add_row(*cells)
    acc = agg["acceptance_rate"]
    vpt = agg["verify_s_per_token"]
    t.caption = (f"aggregate: {agg['tokens']} tokens in {_s(agg['wall_s'])} = {agg['tokens_per_s'] or 0:.1f} tokens/s; "
                 f"{agg['steps']} steps, mean batch {agg['mean_batch'] or 0:.1f} (max {agg['max_batch']}); acceptance "
                 f"{'-' if acc is None else f'{acc:.2f}'}; verify per accepted token {_s(vpt, 'ms')}; "
                 f"mean TT64 {_s(agg['tt64_mean_s'])}")
    t.caption_justify = "left"
    return t
