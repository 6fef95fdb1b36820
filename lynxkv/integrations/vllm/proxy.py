"""``lynxkv vllm-proxy``: an OpenAI-compatible ``/v1/completions`` endpoint in front of a prefill and a decode vLLM
instance, both running :class:`~lynxkv.integrations.vllm.connector.LynxConnector`. No vLLM import.

A request (greedy: ``temperature`` 0) goes through these steps (engine requests in brackets):

1. [prefill] the prompt, ``max_tokens`` 1, ``{"lynx_publish": NAME}``: the prefill instance encodes the prompt's KV
   and its answer names the cache's URL.
2. ``"lynx_mode": "full"`` (in the request body): [decode] the whole completion on the full code, loaded once the
   residual is in. Plain compressed P/D transfer.
3. Otherwise (speculative, the default), at once and side by side: [anchor] the completion drafted on the anchor,
   streamed, under a salt of its own; [full] ``max_tokens`` 1 on the full code, under the full-code salt, which
   ends once the residual is in and the full code is in the decode instance's prefix cache; its token goes to the
   client at once. Then the drafting stops, and the drafts ``d`` (if ``d[0]`` is that token) are checked in one
   prefill: [verify] the prompt plus the drafts under the full-code salt with ``prompt_logprobs`` 1 (the prompt's
   blocks come from the prefix cache, only the draft positions are computed); the longest prefix of drafts that
   are each the full code's argmax is kept (:func:`kept_prefix`), and when every draft is, the verify's own next
   token too. [continue] the rest of the completion from the prompt plus those tokens, again from the prefix cache.
   The client sees only verified tokens. When the residual lands before the first draft, nothing was drafted and
   the proxy goes straight to [continue].

Each request gets a fresh random NAME, and its salts derive from it: anchor KV can never serve a full-code
request. A failed residual ends the request with an error (HTTP 502, one line), or, when the request asked for
``"lynx_allow_anchor_only": true``, finishes on the anchor, flagged ``"lynx": {"anchor_only": true}``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import asdict, dataclass

import aiohttp
from aiohttp import web

from lynxkv.integrations.vllm.engines import Completion, Engine, EngineError

MAX_TOKENS = 1 << 16


class BadRequest(ValueError):
    pass


@dataclass
class Trace:
    """What the proxy did for one request (returned as ``"lynx"`` in the response)."""

    mode: str
    cache_url: str | None = None
    drafted: int = 0
    kept: int = 0
    anchor_only: bool = False
    engine_requests: int = 0
    prefill_s: float = 0.0
    residual_s: float | None = None  # from the start of the decode side to the full code's first token
    verify_s: float | None = None
    first_token_s: float | None = None


@dataclass
class Ask:
    prompt: object
    max_tokens: int
    stream: bool
    mode: str
    allow_anchor_only: bool
    ignore_eos: bool


def parse(body) -> Ask:
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    prompt = body.get("prompt")
    ok = isinstance(prompt, str) and prompt or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 1 << 31 for t in prompt))
    if not ok:
        raise BadRequest("prompt: expected a non-empty string or list of token ids")
    n = body.get("max_tokens", 16)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TOKENS:
        raise BadRequest(f"max_tokens: expected an integer in 1..{MAX_TOKENS}")
    if float(body.get("temperature", 1.0) or 0.0) != 0.0:
        raise BadRequest("temperature: lynxkv vllm-proxy verifies greedy decoding only; send temperature 0")
    if body.get("n", 1) != 1:
        raise BadRequest("n: one completion per request")
    mode = body.get("lynx_mode", "speculative")
    if mode not in ("speculative", "full"):
        raise BadRequest("lynx_mode: expected 'speculative' or 'full'")
    return Ask(prompt, n, bool(body.get("stream", False)), mode, body.get("lynx_allow_anchor_only") is True,
               body.get("ignore_eos") is True)


def kept_prefix(drafts: list[int], prompt_logprobs: list | None, prompt_len: int) -> int:
    """How many drafts the full code keeps, given that ``drafts[0]`` is its own next token: then each ``drafts[j]``
    whose rank in the verify pass's ``prompt_logprobs`` row at its position (``prompt_len + j``) is 1, up to the
    first that is not."""
    rows = prompt_logprobs or []
    kept = 1
    for j in range(1, len(drafts)):
        row = rows[prompt_len + j] if prompt_len + j < len(rows) else None
        entry = (row or {}).get(str(drafts[j]))
        if not isinstance(entry, dict) or entry.get("rank") != 1:
            break
        kept += 1
    return kept


class Proxy:
    """The endpoint (see the module docstring): ``await start()``, then serve at ``url``."""

    def __init__(self, prefill: str, decode: str, *, model: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 300.0, log=None):
        self.prefill_base, self.decode_base = prefill.rstrip("/"), decode.rstrip("/")
        self.model, self.host, self.port, self.timeout = model, host, port, timeout
        self.log = log or (lambda msg: None)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> "Proxy":
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        if self.model is None:
            self.model = await self._model_of(self.decode_base)
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port chosen when 0 was asked for
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _model_of(self, base: str) -> str:
        try:
            async with self._session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return (await resp.json())["data"][0]["id"]
        except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
            raise EngineError(f"{base}: cannot list its model: {exc}") from None

    async def _health(self, request):
        return web.Response(text="ok\n")

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def _engines(self) -> tuple[Engine, Engine]:
        return (Engine(self._session, self.prefill_base, self.model, self.timeout),
                Engine(self._session, self.decode_base, self.model, self.timeout))

    async def _completions(self, request):
        try:
            ask = parse(await request.json())
        except (BadRequest, ValueError) as exc:
            return web.json_response({"error": {"message": f"lynxkv vllm-proxy: {exc}", "code": 400}}, status=400)
        trace = Trace(ask.mode)
        created, rid = int(time.time()), "cmpl-lynx-" + secrets.token_hex(8)

        def chunk(tokens: list[int], text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model,
                    "choices": [{"index": 0, "text": text, "token_ids": tokens, "finish_reason": finish}]}

        response = None
        if ask.stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)

        tokens: list[int] = []
        text = [""]
        prefill = self._engines()[0]

        async def emit(new: list[int], piece: str, finish: str | None = None) -> None:
            tokens.extend(new)
            if new and not piece:  # tokens known without their text (verified drafts): the prefill instance's text
                whole = await prefill.detokenize(tokens)
                piece = whole[len(text[0]):] if whole.startswith(text[0]) else ""
            text[0] += piece
            if response is not None and (new or finish):
                await response.write(b"data: " + json.dumps(chunk(new, piece, finish)).encode() + b"\n\n")

        try:
            finish = await self._serve(ask, trace, emit)
        except EngineError as exc:
            self.log(f"{rid}: {exc}")
            err = {"error": {"message": f"lynxkv vllm-proxy: {exc}", "code": 502}}
            if response is None:
                return web.json_response(err, status=502)
            await response.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            return response
        if response is not None:
            final = chunk([], "", finish)
            final["lynx"] = asdict(trace)
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
            return response
        doc = chunk(tokens, text[0], finish)
        doc["usage"] = {"completion_tokens": len(tokens)}
        doc["lynx"] = asdict(trace)
        return web.json_response(doc)

    async def _serve(self, ask: Ask, trace: Trace, emit) -> str | None:
        prefill, decode = self._engines()
        name = secrets.token_hex(16)
        t0 = time.perf_counter()
        pre = await prefill.complete(ask.prompt, 1, kv_transfer_params={"lynx_publish": name})
        trace.engine_requests += 1
        trace.prefill_s = time.perf_counter() - t0
        url = (pre.kv_transfer_params or {}).get("lynx_url")
        trace.cache_url = url
        prompt = pre.prompt_token_ids
        if not isinstance(url, str) or not prompt:
            raise EngineError(f"{self.prefill_base}: its answer names no lynx cache (is it running LynxConnector "
                              "as kv_producer?)")
        extra = {"ignore_eos": True} if ask.ignore_eos else {}
        if ask.mode == "full":
            return await self._continue(decode, prompt, ask.max_tokens, name + "-full",
                                        {"lynx_url": url, "lynx_mode": "full"}, extra, trace, emit, t0)
        return await self._speculate(decode, prompt, url, ask, name, extra, trace, emit, t0)

    async def _continue(self, decode: Engine, prompt: list[int], n: int, salt: str, params: dict | None, extra: dict,
                        trace: Trace, emit, t0: float) -> str | None:
        out = Completion()
        kw = {"cache_salt": salt, **extra}
        if params:
            kw["kv_transfer_params"] = params
        trace.engine_requests += 1
        seen = seen_text = 0
        async for part in decode.stream(prompt, n, out, **kw):
            new = part.token_ids[seen:]
            if new and trace.first_token_s is None:
                trace.first_token_s = time.perf_counter() - t0
            seen = len(part.token_ids)
            piece, seen_text = part.text[seen_text:], len(part.text)
            await emit(new, piece)
        return out.finish_reason

    async def _speculate(self, decode: Engine, prompt: list[int], url: str, ask: Ask, name: str, extra: dict,
                         trace: Trace, emit, t0: float) -> str | None:
        salt = name + "-full"  # the full code's requests; the anchor's drafting has a salt of its own
        drafts = Completion()
        drafting_done = asyncio.Event()

        async def draft() -> None:
            try:
                async for _ in decode.stream(prompt, ask.max_tokens, drafts, cache_salt=name + "-anchor",
                                             kv_transfer_params={"lynx_url": url, "lynx_mode": "anchor"}, **extra):
                    pass
            finally:
                drafting_done.set()

        t1 = time.perf_counter()
        drafter = asyncio.ensure_future(draft())
        trace.engine_requests += 2
        try:
            first = await decode.complete(prompt, 1, cache_salt=salt,
                                          kv_transfer_params={"lynx_url": url, "lynx_mode": "full"}, **extra)
        except EngineError:
            if not ask.allow_anchor_only:
                drafter.cancel()
                raise
            await drafting_done.wait()  # the anchor's own completion, flagged
            trace.anchor_only, trace.drafted = True, len(drafts.token_ids)
            await emit(drafts.token_ids[:ask.max_tokens], "")
            return drafts.finish_reason
        trace.residual_s = time.perf_counter() - t1
        drafter.cancel()
        await asyncio.gather(drafter, return_exceptions=True)
        g0 = first.token_ids[:1]
        trace.first_token_s = time.perf_counter() - t0
        await emit(g0, "")  # the full code's own first token, at once
        if first.finish_reason == "stop" or ask.max_tokens == 1:
            return first.finish_reason
        d = list(drafts.token_ids[:ask.max_tokens])
        trace.drafted, trace.kept = len(d), int(bool(d) and d[:1] == g0)
        known: list[int] = []  # the tokens after g0 that the full code is known to give
        stopped = False
        if trace.kept and len(d) > 1:
            t2 = time.perf_counter()
            check = await decode.complete(prompt + d, 1, cache_salt=salt, prompt_logprobs=1,
                                          kv_transfer_params={"lynx_verify": True}, **extra)
            trace.engine_requests += 1
            trace.verify_s = time.perf_counter() - t2
            trace.kept = kept_prefix(d, check.prompt_logprobs, len(prompt))
            known = d[1:trace.kept]
            if trace.kept == len(d):
                if drafts.finish_reason == "stop" and len(d) == len(drafts.token_ids):
                    stopped = True  # the drafts ended on a stop token, and the full code agrees
                else:
                    known += check.token_ids[:1]  # the verify pass's own next token
                    stopped = check.finish_reason == "stop"
        known = known[:ask.max_tokens - 1]
        await emit(known, "")
        if stopped:
            return "stop"
        done = 1 + len(known)
        if done >= ask.max_tokens:
            return "length"
        return await self._continue(decode, prompt + g0 + known, ask.max_tokens - done, salt, None, extra, trace,
                                    emit, t0)

async def serve(prefill: str, decode: str, *, host: str, port: int, model: str | None, timeout: float,
                log) -> None:
    proxy = await Proxy(prefill, decode, host=host, port=port, model=model, timeout=timeout, log=log).start()
    log(f"lynxkv vllm-proxy: serving {proxy.url}/v1/completions (prefill {proxy.prefill_base}, "
        f"decode {proxy.decode_base}, model {proxy.model})")
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.close()
