"""``lynxkv eval``: offline evaluation of lynx schemes and the usual KV-cache baselines on real caches."""

from __future__ import annotations

import typer

from lynxkv.cli.app import app
from lynxkv.cli.console import err, model_label, out, print_json, read_text
from lynxkv.errors import InputError


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
    "\n\nMetrics: K/V vNMSE, attention error with the model's queries, teacher-forced draft agreement, KL and "
    "accepted prefix over a W-token window, held-out perplexity change, bits per element with metadata."
)


@app.command("eval", help=HELP)
def eval_command(
    model: str = typer.Option(None, "--model", help="HF model name/path or .gguf file (default: offline SmolLM2)."),
    kv: str = typer.Option(None, "--kv", help="Safetensors KV dump instead of a model (KV-only metrics)."),
    text: str = typer.Option(None, "--text", help="UTF-8 text file to cut prompts from instead of built-in text."),
    corpus: str = typer.Option(
        "builtin", "--corpus",
        help="Where prompts come from: builtin (pydoc topics, the text schemes are chosen on) or stdlib (Python "
        "standard-library source, held out for reporting). --text FILE overrides both.",
    ),
    tokens: str = typer.Option("1000", "--tokens", help="Context lengths in tokens, comma-separated."),
    prompts: int = typer.Option(4, "--prompts", min=1, help="Built-in prompts per length."),
    prompt_offset: int = typer.Option(
        0, "--prompt-offset", min=0, help="Shift the corpus sections the built-in prompts start at (other text)."
    ),
    window: int = typer.Option(64, "--window", min=1, help="Teacher-forced draft window W (tokens)."),
    heldout: int = typer.Option(64, "--heldout", min=0, help="Held-out tokens for the perplexity change (0: off)."),
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
) -> None:
    """Parse, evaluate (lynxkv.eval.suite), print (lynxkv.eval.report)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lynxkv.eval import baselines, report, suite

    if kv and (model or text):
        raise InputError("--kv excludes --model and --text: a KV dump is scored without a model")
    codecs = baselines.select(schemes, sweep=sweep)
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

            from lynxkv.eval.cases import stdlib_text

            lengths = _lengths(tokens)
            if corpus not in ("builtin", "stdlib"):
                raise InputError(f"--corpus: expected builtin or stdlib, got {corpus!r}")
            user_text = read_text(text) if text else (stdlib_text() if corpus == "stdlib" else None)
            corpus_name = (f"text from {text}" if text else
                           "held-out stdlib source" if corpus == "stdlib" else "built-in pydoc prompts")
            err.print(f"loading model {model_label(model)} ...")
            loaded = load_model(model, dtype=torch.float32)
            if loaded.tokenizer is None:
                raise InputError(f"model {loaded.name!r} has no tokenizer; built-in prompts need one")
            result = suite.evaluate_model(
                loaded, codecs, lengths=lengths, prompts=prompts, window=window, heldout=heldout,
                prompt_offset=prompt_offset, text=user_text, progress=progress,
            )
            result["corpus"] = corpus_name
    if plot_dir:
        result["plots"] = report.plot(result, plot_dir)
        err.print(f"wrote {len(result['plots'])} plot(s) to {plot_dir}")
    if as_json:
        print_json(result)
    elif as_markdown:
        out.print(report.markdown(result), markup=False)
    else:
        for table in report.tables(result):
            out.print(table, width=None if out.is_terminal else 180)
    err.print(
        f"{len(codecs)} codecs in {result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU "
        "(vNMSE: per-layer global ratio, mean over layers; prefix: mean ± s.e.m. over prompts)"
    )
