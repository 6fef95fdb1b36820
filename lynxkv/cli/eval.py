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
    import math

    from lynxkv.eval.windows import TIE_MARGIN

    tie_margin = TIE_MARGIN if tie_margin is None else tie_margin
    if not (math.isfinite(tie_margin) and tie_margin >= 0):
        raise InputError(f"--tie-margin: expected a finite number >= 0, got {tie_margin}")
    if task is not None:
        if kv or sweep or heldout_text:
            raise InputError("--task excludes --kv, --sweep and --heldout-text (give task text with --corpus DIR)")
        return _tasks(task, model, corpus, tokens, prompts, ppl_tokens, lengths, depths, trials, dtype, seed,
                      schemes, as_json, as_markdown, plot_dir, threads)
    corpus = corpus or "both"
    tokens = tokens or "1000"
    prompts = prompts or 4
    ppl_tokens = 64 if ppl_tokens is None else ppl_tokens
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lynxkv.eval import baselines, report, suite
    from lynxkv.eval.cases import CHOOSING, Corpus, stdlib_corpus

    if kv and (model or heldout_text or corpus != "both"):
        raise InputError("--kv excludes --model, --corpus and --heldout-text: a KV dump is scored without a model")
    if corpus not in CORPUS_CHOICES:
        raise InputError(f"--corpus: expected one of {', '.join(CORPUS_CHOICES)}, got {corpus!r}")
    roles = CORPUS_CHOICES[corpus]
    if heldout_text and "heldout" not in roles:
        raise InputError("--heldout-text needs the held-out corpus: drop --corpus choosing")
    codecs = baselines.select(schemes, sweep=sweep)
    lengths = _lengths(tokens)
    if threads:
        import torch

        torch.set_num_threads(threads)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True,
    )  # fmt: skip
    with progress:
        if kv:
            result = suite.evaluate_kv(kv, codecs, progress=progress)
        else:
            import torch

            from lynxkv.hf.models import load_model

            corpora = []
            if "heldout" in roles:
                corpora.append(
                    Corpus("heldout", "text from " + ", ".join(heldout_text),
                           "\n\n".join(read_text(p, limit=HELDOUT_LIMIT) for p in heldout_text))
                    if heldout_text else stdlib_corpus()
                )
            if "choosing" in roles:
                corpora.append(CHOOSING)
            err.print(f"loading model {model_label(model)} ...")
            loaded = load_model(model, dtype=torch.float32)
            if loaded.tokenizer is None:
                raise InputError(f"model {loaded.name!r} has no tokenizer; prompts are cut from text")
            result = suite.evaluate_model(
                loaded, codecs, corpora, lengths=lengths, prompts=prompts, window=window, ppl_tokens=ppl_tokens,
                windows=windows, tie_margin=tie_margin, progress=progress,
            )
    if plot_dir:
        result["plots"] = report.plot(result, plot_dir)
        err.print(f"wrote {len(result['plots'])} plot(s) to {plot_dir}")
    if as_json:
        print_json(result)
    elif as_markdown:
        out.print(report.markdown(result), markup=False)
    else:
        for table in report.tables(result):
            out.print(table)
    err.print(
        f"{len(codecs)} codecs in {result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU "
        "(vNMSE: per-layer global ratio, mean over layers; agree, KL, ΔPPL: mean ± s.e.m. over prompts; prefix: "
        "over windows; ties: windows ended on a near-tie)"
    )


def _tasks(spec, model, corpus, tokens, prompts, ppl_tokens, lengths, depths, trials, dtype, seed, schemes,
           as_json, as_markdown, plot_dir, threads) -> None:
    """``--task``: validate everything (the model's context from its configuration alone), then load the model,
    run lynxkv.eval.tasks and print lynxkv.eval.task_report."""
    import torch
    from rich.progress import (
        BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    )  # fmt: skip

    from lynxkv.eval import prose, task_report, tasks
    from lynxkv.hf.models import load_model

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
    if threads:
        torch.set_num_threads(threads)
    err.print(f"task text: {text.name}")
    err.print(f"loading model {model_label(model)} ({dtype}) ...")
    loaded = load_model(model, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    if loaded.tokenizer is None:
        raise InputError(f"model {loaded.name!r} has no tokenizer; the tasks cut their prompts from text")
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=err, transient=True,
    )  # fmt: skip
    with progress:
        result = tasks.evaluate(loaded, text, grid, codecs, progress=progress)
    if plot_dir:
        result["plots"] = task_report.plot(result, plot_dir)
        err.print(f"wrote {len(result['plots'])} plot(s) to {plot_dir}")
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
