"""``lynxkv vllm-proxy``: the OpenAI-compatible endpoint in front of a prefill and a decode vLLM instance
(:mod:`lynxkv.integrations.vllm.proxy`)."""

from __future__ import annotations

import asyncio
from typing import Optional

import typer

from lynxkv.cli.app import app
from lynxkv.cli.console import err, escape
from lynxkv.errors import InputError


def _base(url: str, what: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--{what}: expected http://HOST:PORT of a vLLM OpenAI server, got {url[:80]!r}")
    return url.rstrip("/")


@app.command("vllm-proxy")
def vllm_proxy(
    prefill: str = typer.Option(..., "--prefill", help="The prefill instance: http://HOST:PORT of `vllm serve` "
                                "with LynxConnector as kv_producer."),
    decode: str = typer.Option(..., "--decode", help="The decode instance: http://HOST:PORT of `vllm serve` with "
                               "LynxConnector as kv_consumer."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0 picks a free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    model: Optional[str] = typer.Option(None, "--model", help="The model name the instances serve (default: the "
                                        "decode instance's first)."),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0, help="Seconds an engine request may take."),
) -> None:
    """Serve /v1/completions: prefill on one vLLM instance, decode on the other, drafting on the lynx anchor while
    the residual crosses the network and keeping only the drafts the full code verifies (greedy decoding).

    A request may add "lynx_mode": "full" (wait for the full code: plain compressed transfer) and
    "lynx_allow_anchor_only": true (finish on the anchor, flagged, if the residual fails)."""
    from lynxkv.integrations.vllm.proxy import serve

    prefill, decode = _base(prefill, "prefill"), _base(decode, "decode")

    def log(msg: str) -> None:
        err.print(escape(msg), highlight=False, soft_wrap=True)

    try:
        asyncio.run(serve(prefill, decode, host=host, port=port, model=model, timeout=timeout, log=log))
    except KeyboardInterrupt:
        pass
