"""The proxy's calls to the two vLLM instances: OpenAI ``/v1/completions`` requests over aiohttp, one token stream
at a time. No vLLM import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import aiohttp

from lynxkv.errors import LynxError


class EngineError(LynxError):
    """A vLLM instance refused a request, failed it, or could not be reached."""


@dataclass
class Completion:
    """What one engine request produced."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    kv_transfer_params: dict | None = None


def _absorb(out: Completion, doc: dict, where: str) -> None:
    if "error" in doc or not doc.get("choices"):
        raise EngineError(f"{where}: {json.dumps(doc.get('error', doc))[:300]}")
    choice = doc["choices"][0]
    out.token_ids.extend(choice.get("token_ids") or [])
    out.text += choice.get("text") or ""
    out.finish_reason = choice.get("finish_reason") or out.finish_reason
    if choice.get("prompt_token_ids") is not None:
        out.prompt_token_ids = list(choice["prompt_token_ids"])
    if choice.get("prompt_logprobs") is not None:
        out.prompt_logprobs = choice["prompt_logprobs"]
    if doc.get("kv_transfer_params") is not None:
        out.kv_transfer_params = doc["kv_transfer_params"]


class Engine:
    """One vLLM OpenAI server (``base``: ``http://host:port``) and the model it serves."""

    def __init__(self, session: aiohttp.ClientSession, base: str, model: str, timeout: float):
        self.session, self.base, self.model = session, base.rstrip("/"), model
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    def _body(self, prompt, max_tokens: int, **extra) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **extra}

    async def complete(self, prompt, max_tokens: int, **extra) -> Completion:
        """A whole completion (not streamed)."""
        out = Completion()
        try:
            async with self.session.post(self.base + "/v1/completions", json=self._body(prompt, max_tokens, **extra),
                                         timeout=self.timeout) as resp:
                doc = await resp.json(content_type=None)
                if resp.status != 200:
                    raise EngineError(f"{self.base}: HTTP {resp.status}: {json.dumps(doc)[:300]}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EngineError(f"{self.base}: {type(exc).__name__}: {str(exc)[:200]}") from None
        _absorb(out, doc, self.base)
        return out

    async def stream(self, prompt, max_tokens: int, out: Completion, **extra):
        """A streamed completion: yields after each chunk, with ``out`` holding everything so far. Closing the
        generator closes the connection, which makes vLLM abort the request."""
        body = self._body(prompt, max_tokens, stream=True, **extra)
        try:
            async with self.session.post(self.base + "/v1/completions", json=body, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise EngineError(f"{self.base}: HTTP {resp.status}: {(await resp.text())[:300]}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    _absorb(out, json.loads(data), self.base)
                    yield out
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EngineError(f"{self.base}: {type(exc).__name__}: {str(exc)[:200]}") from None

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` ("" when the instance has no tokenizer)."""
        if not tokens:
            return ""
        try:
            async with self.session.post(self.base + "/detokenize", json={"model": self.model, "tokens": tokens},
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    return ""
                return (await resp.json(content_type=None)).get("prompt", "")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return ""
