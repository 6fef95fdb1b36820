"""``lynxkv encode / decode / inspect / verify``: KV caches in and out of the ``.lynx`` format."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from lynxkv.cli.app import app
from lynxkv.cli.console import err, escape, model_label, out, parse_dtype, print_json, progress_step, read_text
from lynxkv.errors import InputError
from lynxkv.quant.scheme import PRESETS
from lynxkv.storage import has_protocol
from lynxkv.stream.units import format_bytes, parse_size

MEMORY_HELP = ("Hold about this much of the cache in memory at once, e.g. 1GiB: as many layers as fit, at least one "
               "(default: two layers, or one per CPU worker).")
ENCODE_MEMORY_HELP = ("Hold about this much of the dump in memory at once, e.g. 256MiB: each layer is read, "
                      "quantized and written in pieces of whole pages that fit, at least one page (default: 256MiB). "
                      "A dump only.")
ALLOW_HELP = ("Let the cache's recorded residual location lie under this prefix (a path or URL such as "
              "s3://bucket/; repeatable; also $LYNXKV_ALLOW_LOCATIONS, comma-separated). By default only a file "
              "inside the anchor's directory is followed.")


def refuse_overwrite(path: str | os.PathLike, force: bool) -> None:
    """Nothing already stored is replaced unless the user says so."""
    if not force and not has_protocol(str(path)) and os.path.exists(path):
        raise InputError(f"{path} already exists; pass --force to replace it")


def scheme_candidates(name: str, **overrides) -> tuple:
    """The schemes ``--scheme`` names: a preset with the options' overrides, or for ``auto`` the candidates of the
    choice per cache (:data:`lynxkv.hf.choose.CANDIDATES`, each with the overrides), unless an override fixes
    what the candidates differ in (α, the keys' rotation): then the default with the overrides."""
    from lynxkv.hf.choose import LABELS
    from lynxkv.quant.scheme import get_scheme

    if name != "auto":
        return (get_scheme(name, **overrides),)
    if overrides.get("alpha") is not None or overrides.get("key_rotation") is not None:
        return (get_scheme("default", **overrides),)
    return tuple(get_scheme(label, **overrides) for label in LABELS)


@app.command()
def encode(
    input: Optional[Path] = typer.Argument(None, help="A KV dump (.safetensors). Omit it to prefill --model."),
    output: Path = typer.Option(..., "-o", "--output", help="The anchor file to write (.lynx)."),
    residual_out: Optional[str] = typer.Option(None, "--residual-out", help="Where the residual goes, a path or "
                                               "URL (default: OUTPUT with .lynxr)."),
    model: Optional[str] = typer.Option(None, help="Prefill this HF model, .gguf file or offline model "
                                        "(smollm2, the default without INPUT; gemma3-270m)."),
    prompt_file: Optional[Path] = typer.Option(None, help="Prompt text to prefill (default: built-in)."),
    dtype: str = typer.Option("auto", "--dtype", help="The model's dtype for the prefill: auto (the model's own, "
                              "from its config), fp32, bf16 or fp16. The cache stores the KV in it."),
    tokens: int = typer.Option(1000, min=1, help="Length of the built-in prompt, in tokens."),
    scheme: str = typer.Option("auto", help=f"Scheme preset: {', '.join(PRESETS)}; or auto: with --model, the "
                               "one of default and plain-keys whose anchor the model scores closer to the exact "
                               "cache on the prompt's last tokens; for a dump, default."),
    page: Optional[int] = typer.Option(None, help="Tokens per page (P)."),
    chunk: Optional[int] = typer.Option(None, help="Tokens per metadata chunk (C)."),
    alpha: Optional[float] = typer.Option(None, help="α of the α-law compander (switches it on)."),
    anchor_bits: Optional[int] = typer.Option(None, help="Bits of the 8-bit code kept in the anchor."),
    key_rotation: Optional[str] = typer.Option(None, "--key-rotation", help="Rotate the keys along head_dim "
                                               "before quantization: none or hadamard (the default's)."),
    extremes: Optional[str] = typer.Option(None, "--extremes", help="Where the full code decodes the sub-bins that "
                                           "hold each chunk's min and max: midpoint or range (at the chunk's "
                                           "extremes)."),
    single_file: bool = typer.Option(False, "--single-file", help="Anchor and residual in one file."),
    zstd: bool = typer.Option(False, "--zstd", help="zstd-compress each page where it pays."),
    exact: bool = typer.Option(False, "--exact", help="Also write the exact segment, which rebuilds "
                               "the input tensors bit for bit: OUTPUT with .lynxe, or inline with --single-file."),
    exact_out: Optional[str] = typer.Option(None, "--exact-out", help="Where the exact segment goes, a path or URL "
                                            "(implies --exact; default: OUTPUT with .lynxe)."),
    force: bool = typer.Option(False, "--force", help="Replace existing output files."),
    memory: Optional[str] = typer.Option(None, "--memory", help=ENCODE_MEMORY_HELP),
    json: bool = typer.Option(False, "--json", help="Print the cache's description as JSON."),
) -> None:
    """Quantize a KV cache (a safetensors dump, or a model's prefill of a prompt) into a .lynx cache."""
    from lynxkv.cache import default_exact_path, default_residual_path, save_dump
    from lynxkv.hf.encoding import encode_model

    candidates = scheme_candidates(scheme, page=page, chunk=chunk, alpha=alpha, anchor_bits=anchor_bits,
                                   key_rotation=key_rotation, extremes=extremes)
    sch = candidates[0]
    if input is not None and model is not None:
        raise InputError("give either a KV dump file or --model, not both")
    if input is not None and prompt_file is not None:
        raise InputError("--prompt-file is the text to prefill with --model; a KV dump already holds its KV")
    if input is None and memory is not None:
        raise InputError("--memory bounds the encoding of a KV dump; a prefill holds the model's whole cache")
    memory_bytes = parse_size(memory) if memory is not None else None
    torch_dtype = parse_dtype(dtype, auto=True)
    refuse_overwrite(output, force)
    if residual_out is not None and single_file:
        raise InputError("--residual-out and --single-file exclude each other")
    if exact_out is not None and single_file:
        raise InputError("--exact-out and --single-file exclude each other (a single file holds its exact segment)")
    exact = exact or exact_out is not None
    if not single_file:
        refuse_overwrite(residual_out or default_residual_path(output), force)
        if exact:
            refuse_overwrite(exact_out or default_exact_path(output), force)
    if input is not None:
        with progress_step(f"encoding {input}"):
            info = save_dump(input, output, sch, residual_path=residual_out, single_file=single_file, zstd=zstd,
                             exact=exact, exact_path=exact_out, memory=memory_bytes)
    else:
        prompt = read_text(prompt_file) if prompt_file is not None else None
        with progress_step(f"loading {model_label(model)} ({dtype}), prefilling and encoding"):
            info, choice = encode_model(model, output, candidates, prompt=prompt, tokens=tokens,
                                        residual=residual_out, single_file=single_file, zstd=zstd, dtype=torch_dtype,
                                        exact=exact, exact_path=exact_out)
        sch = choice.scheme
    if json:
        print_json({**info.to_dict(), **({"choice": choice.to_dict()} if input is None else {})})
    else:
        if input is None and choice.kl:
            err.print("chose the anchor of " + ", ".join(
                f"{'[bold]' * (s == sch)}{name}{'[/bold]' * (s == sch)} (KL {kl:.2e})"
                for name, s, kl in zip(choice.labels, choice.candidates, choice.kl))
                + f" on the prompt's last {choice.probe_tokens} tokens")
        err.print(
            f"wrote {escape(str(output))} ({info.layers} layers, {info.tokens} tokens, {sch.describe()}): "
            f"anchor {format_bytes(info.anchor_bytes)}, residual {format_bytes(info.residual_bytes)}, "
            f"{info.bits_per_element['total']:.3f} bits/element ({info.bits_per_element['anchor']:.3f} in the anchor)"
            + (f", exact {format_bytes(info.exact_bytes)} (+{info.bits_per_element['exact']:.3f} bits/element)"
               if info.has_exact else "")
        )


@app.command()
def decode(
    cache: str = typer.Argument(..., help="The anchor file (.lynx)."),
    output: Path = typer.Option(..., "-o", "--output", help="The safetensors file to write."),
    anchor_only: bool = typer.Option(False, "--anchor-only", help="Reconstruct from the anchor alone."),
    exact: bool = typer.Option(False, "--exact", help="The original tensors bit for bit, from the full code and "
                               "the exact segment (the original dtype)."),
    dtype: Optional[str] = typer.Option(None, help="Output dtype: bf16, fp16 or fp32 (default: the original)."),
    residual: Optional[str] = typer.Option(None, help="Read the residual from here instead."),
    exact_file: Optional[str] = typer.Option(None, "--exact-file", help="Read the exact segment from here "
                                             "instead (implies --exact)."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
    memory: Optional[str] = typer.Option(None, "--memory", help=MEMORY_HELP),
    json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
) -> None:
    """Turn a .lynx cache back into tensors, with the names and shapes that went in: written layer by layer, a few
    layers in memory at a time, published only once complete."""
    from lynxkv.cache import open_cache, window_for_memory
    from lynxkv.cache.dumps import write_kv_safetensors
    from lynxkv.cache.kv import DTYPE_NAMES, TORCH_DTYPES

    torch_dtype = parse_dtype(dtype) if dtype is not None else None
    exact = exact or exact_file is not None
    if exact and anchor_only:
        raise InputError("--exact and --anchor-only exclude each other")
    refuse_overwrite(output, force)
    memory_bytes = parse_size(memory) if memory is not None else None
    with open_cache(cache, residual=residual, allow_locations=allow_location or (), exact=exact_file) as c, \
            progress_step(f"decoding {cache}"):
        info = c.info
        out_dtype = torch_dtype or TORCH_DTYPES[info.dtype]
        window = None if memory_bytes is None else window_for_memory(
            memory_bytes, c.layer_bytes(anchor_only=anchor_only, dtype=out_dtype))
        meta = {**info.properties, "lynxkv.cache_id": info.cache_id,  # the input's metadata comes back
                "lynxkv.reconstruction": "anchor" if anchor_only else "exact" if exact else "full"}
        # closed before the cache is: a write that fails waits for the layers being decoded ahead; each layer is
        # written before the next is asked for, so its tensors take the next layers' decoding (recycle)
        with contextlib.closing(c.iter_layers(anchor_only=anchor_only, dtype=torch_dtype, exact=exact,
                                              window=window, recycle=True)) as layers:
            write_kv_safetensors(output, layers, layers=info.layers,
                                 shape=(info.kv_heads, info.tokens, info.head_dim), dtype=out_dtype, names=info.names,
                                 batched=info.batch_dim, metadata=meta)
    if json:
        print_json({"output": str(output), "layers": info.layers, "kv_heads": info.kv_heads, "tokens": info.tokens,
                    "head_dim": info.head_dim, "dtype": DTYPE_NAMES[out_dtype], "names": list(info.names or []),
                    "reconstruction": meta["lynxkv.reconstruction"], "cache_id": info.cache_id})
        return
    err.print(f"wrote {escape(str(output))} ({info.layers} layers, {meta['lynxkv.reconstruction']} reconstruction)")


@app.command()
def inspect(
    cache: str = typer.Argument(..., help="The anchor file (.lynx)."),
    residual: Optional[str] = typer.Option(None, help="Look for the residual here instead."),
    check_residual: Optional[bool] = typer.Option(None, "--check-residual/--no-check-residual", help="Open the "
                                                  "residual to see whether it is reachable (default: only when it "
                                                  "is inline or a file in the anchor's directory)."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a cache's scheme, shape, pages, sizes and bits per element, and where its residual lives."""
    from lynxkv.cache import open_cache

    with open_cache(cache, residual=residual, allow_locations=allow_location or ()) as c:
        d = c.describe(check_residual=True if residual is not None and check_residual is None else check_residual)
    if json:
        print_json(d)
        return
    t = Table(title=f"{cache}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("scheme", d["scheme_description"])
    t.add_row("shape", f"{d['layers']} layers × {d['kv_heads']} KV heads × {d['tokens']} tokens × "
                       f"{d['head_dim']} head dim ({d['dtype']})")
    t.add_row("pages", f"{d['pages_per_layer']} per layer of {d['scheme']['page']} tokens")
    t.add_row("anchor", f"{format_bytes(d['anchor_bytes'])} ({d['bits_per_element']['anchor']:.3f} bits/element)")
    res_where = "inline (single file)" if d["residual_inline"] else d["residual_location"]
    reach = {True: "reachable", False: "NOT reachable", None: "not checked (--check-residual)"}
    t.add_row("residual", f"{format_bytes(d['residual_bytes'])} at {res_where}: {reach[d['residual_reachable']]}")
    if d["has_exact"]:
        ex_where = "inline" if d["exact_inline"] else d["exact_location"]
        t.add_row("exact", f"{format_bytes(d['exact_bytes'])} (+{d['bits_per_element']['exact']:.3f} bits/element) "
                           f"at {ex_where}: {reach[d.get('exact_reachable')]}")
    else:
        t.add_row("exact", "none (the full code is the most precise reconstruction)")
    t.add_row("total", f"{d['bits_per_element']['total']:.3f} bits/element "
                       f"({d['bits_per_element']['total_codes']:.0f} without metadata)")
    t.add_row("prompt", f"{len(d['prompt_token_ids'])} token ids" if d.get("prompt_token_ids") else "not stored")
    props = d["properties"]
    ran_in = props.get("lynxkv.model_dtype") and f"ran in {props['lynxkv.model_dtype']}"
    fingerprint = d["model_fingerprint"] and f"fingerprint {d['model_fingerprint']}"
    details = ", ".join(filter(None, [ran_in, fingerprint]))
    t.add_row("model", escape(" ".join(filter(None, [props.get("lynxkv.model"), details and f"({details})"])))
              or "not recorded")
    t.add_row("cache id", d["cache_id"])
    out.print(t)


@app.command()
def verify(
    cache: str = typer.Argument(..., help="The anchor file (.lynx)."),
    residual: Optional[str] = typer.Option(None, help="Check the residual at this location instead."),
    exact_file: Optional[str] = typer.Option(None, "--exact-file", help="Check the exact segment at this location "
                                             "instead."),
    against: Optional[Path] = typer.Option(None, help="The original KV dump: report vNMSE per layer."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    memory: Optional[str] = typer.Option(None, "--memory", help=MEMORY_HELP + " Pages are checked one at a time; "
                                         "this bounds the exact segment's check."),
    json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check every segment's structure and checksums (exit 1 on any finding), and with an exact segment that it
    rebuilds the original bytes of every page; optionally measure error."""
    from lynxkv.eval.metrics import reconstruction_error
    from lynxkv.cache import verify_file

    allow = tuple(allow_location or ())
    findings = verify_file(cache, residual=residual, allow_locations=allow, exact=exact_file,
                           memory=parse_size(memory) if memory is not None else None)
    result: dict = {"ok": not findings, "findings": [f.to_dict() for f in findings]}
    if against is not None and not findings:
        result["vnmse"] = reconstruction_error(cache, against, residual=residual, allow_locations=allow)
    if json:
        print_json(result)
    else:
        for f in findings:
            err.print(f"[red]FAIL[/] {escape(str(f))}")
        if "vnmse" in result:
            _print_vnmse(result["vnmse"])
        err.print("[green]OK[/]: structure and checksums of every segment verified" if not findings
                  else f"[red]{len(findings)} finding(s)[/]")
    if findings:
        raise typer.Exit(1)


def _print_vnmse(v: dict) -> None:
    t = Table(title="vNMSE = Σ‖x̂−x‖² / Σ‖x‖² per layer", title_justify="left")
    for col in ("layer", "K full", "V full", "K anchor", "V anchor"):
        t.add_column(col, justify="right")
    for i, row in enumerate(v["per_layer"]):
        t.add_row(str(i), *(f"{row[k]:.3e}" for k in ("key_full", "value_full", "key_anchor", "value_anchor")))
    m = v["mean"]
    t.add_row("mean", *(f"{m[k]:.3e}" for k in ("key_full", "value_full", "key_anchor", "value_anchor")),
              style="bold")
    out.print(t)
