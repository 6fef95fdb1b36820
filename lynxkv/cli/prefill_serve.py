"""``lynxkv prefill``: a prefill process that serves its cache over HTTP while it encodes it."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from lynxkv.cli.app import app
from lynxkv.cli.codec import refuse_overwrite
from lynxkv.cli.console import err, escape, model_label, parse_dtype, print_json, read_text
from lynxkv.errors import InputError
from lynxkv.quant.scheme import PRESETS


@app.command()
def prefill(
    model: Optional[str] = typer.Option(None, help="The HF model to prefill (default: the offline SmolLM2)."),
    prompt_file: Optional[Path] = typer.Option(None, help="Prompt text to prefill (default: built-in)."),
    tokens: int = typer.Option(1000, min=1, help="Length of the built-in prompt, in tokens."),
    dtype: str = typer.Option("auto", "--dtype", help="The model's dtype: auto, fp32, bf16 or fp16."),
    scheme: str = typer.Option("default", help=f"Scheme preset: {', '.join(PRESETS)}."),
    port: int = typer.Option(7070, "--port", min=0, max=65535, help="TCP port (0 picks a free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    name: Optional[str] = typer.Option(None, "--name", help="The anchor's URL name (default: OUT's file name, "
                                       "else prefill.lynx); the residual is served beside it as NAME.lynxr."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also save the finished cache here (its residual "
                                       "beside it), atomically, once every page is written."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out cache."),
    dscp_anchor: str = typer.Option(None, "--dscp-anchor", help="DSCP class of anchor responses (EF, AF41, 46)."),
    dscp_residual: str = typer.Option(None, "--dscp-residual", help="DSCP class of residual responses (CS1)."),
    wait_timeout: float = typer.Option(120.0, "--wait-timeout", min=0.1, help="Seconds a response waits for "
                                       "bytes not yet written before it is cut off."),
    write_buffer: str = typer.Option("256KiB", "--write-buffer", help="Bytes queued per connection (and its "
                                     "kernel send buffer): what a killed prefill process still delivers."),
    start_on_request: bool = typer.Option(False, "--start-on-request", help="Start the prefill when the first "
                                          "client asks for the cache (a decoder that connects first)."),
    once: bool = typer.Option(False, "--once", help="Exit after every byte of the cache has been sent once."),
    as_json: bool = typer.Option(False, "--json", help="Print the address as JSON on stdout once listening, "
                                 "and the prefill's timings once published."),
) -> None:
    """Prefill a prompt and serve its cache over HTTP while it is encoded: each anchor page is readable as soon
    as it is written, the residual behind it on its own DSCP class, the header once whole. A reader never gets a
    byte that is not final: it waits for it (up to --wait-timeout), and if the prefill fails its responses are
    cut off. `lynxkv run http://HOST:PORT/NAME` decodes from it as from `lynxkv serve`.

    SIGTERM or Ctrl-C stops it (a prefill in progress is abandoned: nothing reaches --out)."""
    from lynxkv.hf.models import encode_prompt, load_model, model_properties
    from lynxkv.hf.prompts import builtin_prompt
    from lynxkv.quant.scheme import get_scheme
    from lynxkv.serve import parse_dscp
    from lynxkv.serve.publisher import PrefillPublisher, check_name
    from lynxkv.serve.publish import PublishServer
    from lynxkv.cache import default_residual_path
    from lynxkv.stream.units import parse_size

    sch = get_scheme(scheme)
    if name is not None:
        check_name(name)
    if out is not None:
        if name is not None and name != out.name:
            raise InputError(f"--name {name!r} and --out {out}: the served name is --out's file name")
        refuse_overwrite(out, force)
        refuse_overwrite(default_residual_path(out), force)
        if not os.path.isdir(out.parent):
            raise InputError(f"--out {out}: directory {out.parent} does not exist")
    text = read_text(prompt_file) if prompt_file is not None else None
    marks = parse_dscp(dscp_anchor), parse_dscp(dscp_residual)
    loaded = load_model(model, dtype=parse_dtype(dtype, auto=True))
    ids = encode_prompt(loaded, text if text is not None else builtin_prompt(loaded.tokenizer, tokens))
    pub = PrefillPublisher(loaded.model, ids, sch, name=name or (out.name if out is not None else "prefill.lynx"),
                           out=out, fingerprint=loaded.fingerprint, properties=model_properties(loaded))
    server = PublishServer(pub.files, pub.cache_id.hex(), host=host, port=port, dscp_anchor=marks[0],
                           dscp_residual=marks[1], wait_timeout=wait_timeout, write_buffer=parse_size(write_buffer),
                           log=lambda msg: err.print(msg, highlight=False))
    _serve(server, pub, start_on_request, once, as_json, model_label(model))


def _serve(server, pub, start_on_request: bool, once: bool, as_json: bool, label: str) -> None:
    """Run the prefill on this thread while the server runs on its own; then serve until a signal (or --once)."""
    stopping, running = threading.Event(), threading.Event()

    def stop(*_) -> None:
        stopping.set()
        if running.is_set():  # the forward pass runs on this thread: interrupt it (the files then fail)
            raise KeyboardInterrupt

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, stop)
    server.start()
    try:
        if as_json:
            print_json(server.describe())
        err.print(f"publishing {pub.report.tokens} tokens of {escape(label)} at {server.url}", highlight=False,
                  soft_wrap=True)
        if start_on_request:
            while not server.requested.wait(0.1):
                if stopping.is_set():
                    return
        running.set()
        report = pub.run()
        running.clear()
        err.print(f"published: forward {report.forward_s:.3f} s, anchor final {report.anchor_s:.3f} s, all "
                  f"{report.done_s:.3f} s" + (f"; saved {escape(report.saved[-1])}" if report.saved else ""),
                  highlight=False, soft_wrap=True)
        if as_json:
            print_json({"published": vars(report)})
        while not stopping.wait(0.1):
            if once and server.sent_once():
                break
    finally:
        pub.fail("the prefill process is stopping")
        server.close()
        for s, handler in before.items():
            if handler is not signal.SIG_IGN:
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
