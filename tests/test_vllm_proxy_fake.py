"""``lynxkv vllm-proxy`` against two stand-in vLLM servers (aiohttp, the OpenAI completions API as vLLM answers it
with LynxConnector): the proxy's orchestration without vLLM. The stand-ins' "full code" is a fixed greedy rule, their
anchor follows it for a few tokens and then drifts; the full code is ready ``RESIDUAL_S`` after it is asked for.
tests/test_vllm_proxy.py runs the real thing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from lynxkv.integrations.vllm.proxy import Proxy

pytestmark = pytest.mark.network

PROMPT = [5, 9, 2, 7, 3, 8, 1, 4]
AGREE = 5  # the anchor gives the full code's tokens for this many steps after the prompt, then drifts
RESIDUAL_S = 0.3


def full_next(seq: list[int]) -> int:
    return (sum(seq[-3:]) * 7 + len(seq)) % 50 + 1


def anchor_next(seq: list[int]) -> int:
    tok = full_next(seq)
    return tok if len(seq) < len(PROMPT) + AGREE else tok % 50 + 2


def greedy(prompt: list[int], n: int, step=full_next) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(step(seq))
    return seq[len(prompt):]


class Engines:
    """Both stand-ins on one server (prefill at /p, decode at /d), every request recorded."""

    def __init__(self, fail_full: bool = False):
        self.requests: list[tuple[str, dict]] = []
        self.fail_full = fail_full

    async def completions(self, request):
        side = request.match_info["side"]
        body = await request.json()
        self.requests.append((side, body))
        prompt, n = body["prompt"], body["max_tokens"]
        params = body.get("kv_transfer_params") or {}
        if side == "p":
            return web.json_response({"choices": [{"token_ids": [full_next(prompt)], "text": "",
                                                   "prompt_token_ids": prompt, "finish_reason": "length"}],
                                      "kv_transfer_params": {"lynx_url": f"http://store/{params['lynx_publish']}.lynx"}})
        mode = params.get("lynx_mode")
        if mode == "full":
            await asyncio.sleep(RESIDUAL_S)
            if self.fail_full:
                return web.json_response({"error": {"message": "KV load failed", "code": 500}}, status=500)
        step = anchor_next if mode == "anchor" else full_next
        tokens = greedy(prompt, n, step)
        choice = {"token_ids": tokens, "text": "", "finish_reason": "length"}
        if body.get("prompt_logprobs"):
            rows = [None] + [{str(prompt[p]): {"logprob": -0.5, "rank": 1 if prompt[p] == full_next(prompt[:p])
                                                else 3}} for p in range(1, len(prompt))]
            choice["prompt_logprobs"] = rows
        if not body.get("stream"):
            return web.json_response({"choices": [choice]})
        resp = web.StreamResponse()
        await resp.prepare(request)
        for tok in tokens:
            await asyncio.sleep(0.02)  # one decode step
            doc = {"choices": [{"token_ids": [tok], "text": "", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"choices": [{"token_ids": [], "text": "",
                                                              "finish_reason": "length"}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _detokenize(request):
    return web.json_response({"prompt": ""})


async def _run(engines: Engines, bodies: list[dict]) -> list[tuple[int, dict]]:
    app = web.Application()
    app.router.add_post("/{side}/v1/completions", engines.completions)
    app.router.add_post("/{side}/detokenize", _detokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    proxy = await Proxy(base + "/p", base + "/d", model="m").start()
    try:
        async with aiohttp.ClientSession() as s:
            async def one(body):
                async with s.post(proxy.url + "/v1/completions", json=body) as r:
                    return r.status, await r.json()
            return await asyncio.gather(*(one(b) for b in bodies))
    finally:
        await proxy.close()
        await runner.cleanup()


def _body(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, **kw}


def test_speculative_gives_the_full_codes_tokens_and_keeps_the_drafts_it_agrees_with():
    engines = Engines()
    (status, doc), = asyncio.run(_run(engines, [_body()]))
    assert status == 200
    assert doc["choices"][0]["token_ids"] == greedy(PROMPT, 24)
    trace = doc["lynx"]
    assert trace["drafted"] > AGREE and trace["kept"] == AGREE
    assert trace["engine_requests"] == 5  # prefill, anchor, full, verify, continue


def test_full_mode_waits_for_the_full_code():
    engines = Engines()
    (status, doc), = asyncio.run(_run(engines, [_body(lynx_mode="full")]))
    assert status == 200 and doc["choices"][0]["token_ids"] == greedy(PROMPT, 24)
    modes = [(b.get("kv_transfer_params") or {}).get("lynx_mode") for side, b in engines.requests if side == "d"]
    assert modes == ["full"]


def test_anchor_kv_never_shares_a_salt_with_the_full_code_or_another_request():
    engines = Engines()
    results = asyncio.run(_run(engines, [_body(), _body()]))
    assert all(status == 200 for status, _ in results)
    anchor = {b["cache_salt"] for side, b in engines.requests
              if side == "d" and (b.get("kv_transfer_params") or {}).get("lynx_mode") == "anchor"}
    other = {b["cache_salt"] for side, b in engines.requests
             if side == "d" and (b.get("kv_transfer_params") or {}).get("lynx_mode") != "anchor"}
    assert len(anchor) == 2 and len(other) == 2  # one anchor salt and one full-code salt per request
    assert not anchor & other
    urls = {b["kv_transfer_params"]["lynx_url"] for side, b in engines.requests
            if side == "d" and "lynx_url" in (b.get("kv_transfer_params") or {})}
    assert len(urls) == 2


def test_a_failed_full_code_is_one_error_or_the_flagged_anchor_when_asked():
    (status, doc), = asyncio.run(_run(Engines(fail_full=True), [_body()]))
    assert status == 502 and doc["error"]["message"].startswith("lynxkv vllm-proxy:")
    (status, doc), = asyncio.run(_run(Engines(fail_full=True), [_body(lynx_allow_anchor_only=True)]))
    assert status == 200 and doc["lynx"]["anchor_only"] is True
    assert doc["choices"][0]["token_ids"] == greedy(PROMPT, 24, anchor_next)


def test_a_request_the_proxy_cannot_verify_is_refused_before_any_engine_is_asked():
    engines = Engines()
    (status, doc), = asyncio.run(_run(engines, [_body(temperature=0.8)]))
    assert status == 400 and "greedy" in doc["error"]["message"]
    assert engines.requests == []
