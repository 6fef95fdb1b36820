"""``lynxkv eval``: offline evaluation of lynx schemes and the usual KV-cache baselines on real caches."""

from __future__ import annotations

import typer

from lynxkv.cli.app import app
from lynxkv.cli.console import err, model_label, out, print_json, read_text
from lynxkv.errors import InputError

#: A held-out corpus is read whole, like a prompt, but may be a book or several: larger than a prompt's limit.
HELDOUT_LIMIT = 1 << 30


def _lengths(spec: str) -> list[int]:
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--tokens: expected comma-separated integers like 1000,4000, got {spec!r}") from None
    if not values or any(v < 2 for v in values):
        raise InputError(f"--tokens: expected lengths >= 2, got {spec!r}")
    return values


HELP = (
    "Score lynx schemes against BF16, FP8, INT8/INT4, grouped INT (HF QuantizedCache) and KIVI on real KV caches."
    "\n\nTwo corpora that share no text: the held-out one (Python standard-library source, or --heldout-text "
    "files), which had no part in choosing a scheme and is the one to report, and the choosing one (the built-in "
    "prompts the schemes are tuned on)."
    "\n\nMetrics: K/V vNMSE, attention error with the model's queries, teacher-forced draft agreement, KL and "
    "accepted prefix over W-token windows (--windows per prompt; near-ties counted apart; lynx anchors also against "
    "their own full code), perplexity change on each prompt's continuation, bits per element "
    "with metadata."
    "\n\nWith --task: task accuracy instead, on English prose no default was chosen on (standard-library "
    "docstrings, or --corpus DIR): perplexity of held-out documents and passkey retrieval by depth and length on "
    "each code's decoded cache, with 95% intervals."
)

#: --corpus: which corpora a run scores, held-out first (the one to report).
CORPUS_CHOICES = {"both": ("heldout", "choosing"), "heldout": ("heldout",), "choosing": ("choosing",)}


@app.command("eval", help=HELP)
def eval_command(
    model: str = typer.Option(None, "--model", help="HF model name/path, .gguf file or offline model: "
                               "smollm2 (the default), gemma3-270m."),
    kv: str = typer.Option(None, "--kv", help="Safetensors KV dump instead of a model (KV-only metrics)."),
    corpus: str = typer.Option(
        None, "--corpus", help="Which corpora to score: both (default), heldout or choosing (the held-out one is "
        "reported first; held-out text is cut so that it shares no 32-token run with the choosing corpus either "
        "way). With --task: a directory whose *.txt, *.md and *.rst files replace the default task text "
        "(standard-library docstrings).",
    ),
    heldout_text: list[str] = typer.Option(
        None, "--heldout-text", metavar="FILE", help="UTF-8 text file for the held-out corpus instead of the standard-library source "
        "(repeat for several files; pieces overlapping the choosing corpus are skipped).",
    ),
    tokens: str = typer.Option(
        None, "--tokens", help="Context lengths in tokens, comma-separated (default 1000). With --task: the "
        "perplexity documents' context (default 1024).",
    ),
    prompts: int = typer.Option(
        None, "--prompts", min=1, help="Prompts per corpus and length (default 4). With --task: perplexity "
        "documents (default 8).",
    ),
    window: int = typer.Option(64, "--window", min=1, help="Teacher-forced draft window W (tokens)."),
    windows: int = typer.Option(
        1, "--windows", min=1, help="Windows per prompt: window i starts after the prompt and the first i·W tokens "
        "of the text that follows it; the accepted prefix is pooled over windows (mean ± s.e.m.).",
    ),
    tie_margin: float = typer.Option(
        None, "--tie-margin", help="A window whose first disagreement falls where the exact top-2 logit margin is "
        "below this is a near-tie, counted apart (column 'ties'; default 0.1, lynxkv.eval.windows.TIE_MARGIN).",
    ),
    ppl_tokens: int = typer.Option(
        None, "--ppl-tokens", min=0, help="Tokens of each prompt's continuation for the perplexity change (default "
        "64; 0: off). With --task: tokens scored per perplexity document (default 256).",
    ),
    schemes: str = typer.Option(None, "--schemes", help="Comma-separated codec names (default: all)."),
    sweep: bool = typer.Option(
        False, "--sweep", help="Ablation of lynx schemes, one factor at a time around the default (no baselines)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the full result as JSON on stdout."),
    as_markdown: bool = typer.Option(False, "--markdown", help="Print the tables as Markdown on stdout."),
    plot_dir: str = typer.Option(None, "--plot", help="Write PNG plots into this directory."),
    threads: int = typer.Option(
        1, "--threads", min=0, help="torch intra-op threads (0: torch's default). One is fastest on a busy machine."
    ),
    task: str = typer.Option(
        None, "--task", help="Task accuracy instead of the draft metrics: perplexity, passkey or all "
        "(comma-separated): see docs/evaluation.md, 'Task accuracy'.",
    ),
    lengths: str = typer.Option(
        "1K,2K", "--lengths", help="With --task passkey: prompt lengths in tokens, answer included (K = 1024; the "
        "full grid: 1K,2K,4K,8K).",
    ),
    depths: str = typer.Option(
        "0,0.25,0.5,0.75,1", "--depths",
        help="With --task passkey: depths of the key in the filler (0: first, 1: last).",
    ),
    trials: int = typer.Option(2, "--trials", min=1, help="With --task passkey: keys per (length, depth) cell."),
    dtype: str = typer.Option("fp32", "--dtype", help="With --task: the model's dtype, fp32 or bf16."),
    seed: int = typer.Option(0, "--seed", help="With --task passkey: seed of the keys and filler windows."),
) -> None:
    """Parse, evaluate (lynxkv.eval.suite, or lynxkv.eval.tasks with --task), print (lynxkv.eval.report)."""
    tie_margin = _tie_margin(tie_margin)
    if task is not None:
        if kv or sweep or heldout_text:
            raise InputError("--task excludes --kv, --sweep and --heldout-text (give task text with --corpus DIR)")
        return _tasks(task, model, corpus, tokens, prompts, ppl_tokens, lengths, depths, trials, dtype, seed,
                      schemes, as_json, as_markdown, plot_dir, threads)
    from lynxkv.eval.baselines import select

    roles = _roles(kv, model, corpus or "both", heldout_text)
    codecs = select(schemes, sweep=sweep)
    context = _lengths(tokens or "1000")
    _set_threads(threads)
    result = _score(kv, model, roles, heldout_text, codecs, lengths=context, prompts=prompts or 4, window=window,
                    ppl_tokens=64 if ppl_tokens is None else ppl_tokens, windows=windows, tie_margin=tie_margin)
    _print_scores(result, len(codecs), plot_dir, as_json, as_markdown)


def _score(kv: str | None, model: str | None, roles: tuple[str, ...], heldout_text: list[str] | None, codecs,
           **settings) -> dict:
    """Score ``codecs`` on the KV dump ``kv`` (KV-only metrics), or on the corpora of ``roles`` with the model
    (loaded in fp32) under ``settings`` (lynxkv.eval.suite), with a progress display."""
    from lynxkv.eval import suite

    with _progress() as progress:
        if kv:
            return suite.evaluate_kv(kv, codecs, progress=progress)
        corpora = _corpora(roles, heldout_text)
        err.print(f"loading model {model_label(model)} ...")
        loaded = _load(model, "fp32", "prompts are cut from text")
        return suite.evaluate_model(loaded, codecs, corpora, progress=progress, **settings)


def _print_scores(result: dict, codecs: int, plot_dir: str | None, as_json: bool, as_markdown: bool) -> None:
    """The plots (``--plot``), the draft-metrics result on stdout (JSON, Markdown or tables), then its time and how
    to read it on stderr."""
    from lynxkv.eval import report

    _plot(result, report.plot, plot_dir)
    if as_json:
        print_json(result)
    elif as_markdown:
        out.print(report.markdown(result), markup=False)
    else:
        for table in report.tables(result):
            out.print(table)
    err.print(
        f"{codecs} codecs in {result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU "
        "(vNMSE: per-layer global ratio, mean over layers; agree, KL, ΔPPL: mean ± s.e.m. over prompts; prefix: "
        "over windows; ties: windows ended on a near-tie)"
    )


def _tie_margin(value: float | None) -> float:
    """``--tie-margin``, its default filled in, checked."""
    import math

    from lynxkv.eval.windows import TIE_MARGIN

    value = TIE_MARGIN if value is None else value
    if not (math.isfinite(value) and value >= 0):
        raise InputError(f"--tie-margin: expected a finite number >= 0, got {value}")
    return value


def _roles(kv: str | None, model: str | None, corpus: str, heldout_text: list[str] | None) -> tuple[str, ...]:
    """The corpora a draft-metrics run scores (``CORPUS_CHOICES``), after checking the options that pick them."""
    if kv and (model or heldout_text or corpus != "both"):
        raise InputError("--kv excludes --model, --corpus and --heldout-text: a KV dump is scored without a model")
    if corpus not in CORPUS_CHOICES:
        raise InputError(f"--corpus: expected one of {', '.join(CORPUS_CHOICES)}, got {corpus!r}")
    roles = CORPUS_CHOICES[corpus]
    if heldout_text and "heldout" not in roles:
        raise InputError("--heldout-text needs the held-out corpus: drop --corpus choosing")
    return roles


def _corpora(roles: tuple[str, ...], heldout_text: list[str] | None) -> list:
    """The corpora of ``roles``, held-out first: ``--heldout-text`` files read whole, else the standard library."""
    from lynxkv.eval.cases import CHOOSING, Corpus, stdlib_corpus

    corpora = []
    if "heldout" in roles:
        corpora.append(
            Corpus("heldout", "text from " + ", ".join(heldout_text),
                   "\n\n".join(read_text(p, limit=HELDOUT_LIMIT) for p in heldout_text))
            if heldout_text else stdlib_corpus()
        )
    if "choosing" in roles:
        corpora.append(CHOOSING)
    return corpora


def _set_threads(threads: int) -> None:
    """``--threads``: torch's intra-op threads (0 leaves torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _load(model: str | None, dtype: str, why_tokenizer: str):
    """The model in ``dtype`` (fp32 or bf16), refused without a tokenizer (``why_tokenizer`` says what needs it)."""
    import torch

    from lynxkv.hf.models import load_model

    loaded = load_model(model, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    if loaded.tokenizer is None:
        raise InputError(f"model {loaded.name!r} has no tokenizer; {why_tokenizer}")
    return loaded


def _progress(*columns):
    """A transient progress display on stderr: description, bar, done of total, elapsed, then ``columns``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), *columns,
        console=err, transient=True,
    )  # fmt: skip


def _plot(result: dict, plot, plot_dir: str | None) -> None:
    """``--plot DIR``: write the plots (``plot(result, DIR)``), list them in the result and say so on stderr."""
    if plot_dir:
        result["plots"] = plot(result, plot_dir)
        err.print(f"wrote {len(result['plots'])} plot(s) to {plot_dir}")


def _tasks(spec, model, corpus, tokens, prompts, ppl_tokens, lengths, depths, trials, dtype, seed, schemes,
           as_json, as_markdown, plot_dir, threads) -> None:
    """``--task``: validate everything (the model's context from its configuration alone), then load the model,
    run lynxkv.eval.tasks and print lynxkv.eval.task_report."""
    from rich.progress import TimeRemainingColumn

    from lynxkv.eval import prose, task_report, tasks

    names = tasks.parse_tasks(spec)
    context = tokens and tasks.parse_lengths(tokens, "--tokens")
    if context and len(context) > 1:
        raise InputError(f"--tokens: with --task, one perplexity context, got {tokens!r}")
    if dtype not in ("fp32", "bf16"):
        raise InputError(f"--dtype: expected fp32 or bf16, got {dtype!r}")
    grid = tasks.Grid(
        tasks=names, context=context[0] if context else 1024, scored=256 if ppl_tokens is None else ppl_tokens,
        documents=prompts or 8, lengths=tasks.parse_lengths(lengths), depths=tasks.parse_depths(depths),
        trials=trials, seed=seed,
    )  # fmt: skip
    if "perplexity" in names and grid.scored < 1:
        raise InputError("--ppl-tokens: the perplexity task scores at least 1 token")
    if corpus == "choosing":
        raise InputError("--corpus choosing: tasks never read the choosing corpus; give a directory or leave it out")
    text = prose.default_corpus() if corpus in (None, "both", "heldout") else prose.directory_corpus(corpus)
    codecs = tasks.task_codecs(schemes)
    tasks.check_context(grid, tasks.model_context(model), model_label(model))
    _set_threads(threads)
    err.print(f"task text: {text.name}")
    err.print(f"loading model {model_label(model)} ({dtype}) ...")
    loaded = _load(model, dtype, "the tasks cut their prompts from text")
    with _progress(TimeRemainingColumn()) as progress:
        result = tasks.evaluate(loaded, text, grid, codecs, progress=progress)
    _plot(result, task_report.plot, plot_dir)
    if as_json:
        print_json(result)
    elif as_markdown:
        out.print(task_report.markdown(result), markup=False)
    elif out.is_terminal:
        out.print(task_report.table(result))
        for line in task_report.target_lines(result):
            out.print(line, markup=False)
    else:
        out.print(task_report.plain(result), markup=False)
    err.print(f"{len(codecs)} codecs in {result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU "
              "(ΔPPL: mean ± s.e.m. over documents; passkey: exact match of greedy decoding, Wilson 95% interval)")
