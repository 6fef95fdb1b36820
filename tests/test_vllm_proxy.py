"""Lynx inside vLLM across a real shaped link: a prefill ``vllm serve`` (LynxConnector, kv_producer) in one lab
namespace, a decode ``vllm serve`` (kv_consumer) and ``lynxkv vllm-proxy`` in the other, 12 Mbit/s between them
(vLLM's CPU build, a tiny random Llama in fp32, ``--enforce-eager``). ``make test-vllm`` (its own venv, marker
``vllm``; a few minutes on 2 cores).

What it checks, on one pair of engines: the proxy's greedy output in speculative mode is the full-code output
(``lynx_mode: full``: the decode instance's own greedy decoding on the loaded full code) token for token, with
drafts kept; eight concurrent requests return what they return alone; a cache made from another prompt fails that
request only; a cache that never arrives ends the request with one error within the timeout, and the engines
serve the next request as before."""

from __future__ import annotations

import os

import threading
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.network]
pytest.importorskip("vllm", reason="vLLM is not installed here: run `make test-vllm`")

from lynxkv.bench.netlab import can_create_lab  # noqa: E402
from lynxkv.bench.vllm_lab import VllmLab  # noqa: E402

TOKENS = 64


def _tiny_llama(path) -> None:
    """4 layers x 4 KV heads x 32 head dim (vLLM's CPU attention wants multiples of 32), a word-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runner_helpers import save_tiny_model_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    save_tiny_model_dir(LlamaForCausalLM(cfg).eval(), path)


def _prompt(seed: int, n: int = 1500) -> list[int]:
    return [(i * (31 + 2 * seed) + 7 * seed) % 500 + 3 for i in range(n)]


def _tokens(reply: dict) -> list[int]:
    assert reply["status"] == 200, reply
    return reply["body"]["choices"][0]["token_ids"]


def test_the_proxy_keeps_drafts_and_gives_the_full_codes_tokens_across_a_shaped_link(tmp_path):
    if (reason := can_create_lab()) is not None:
        pytest.skip(reason)
    model = tmp_path / "model"
    _tiny_llama(model)
    with VllmLab(model, tmp_path, rate="12Mbit", timeout_s=30) as vl:
        store = vl.store

        def body(seed: int, **kw) -> dict:
            return {"prompt": _prompt(seed), "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **kw}

        # alone, one at a time: full mode, then speculative, per prompt
        full, spec = {}, {}
        for seed in range(3):
            full[seed] = vl.send([body(seed, lynx_mode="full")])[0]
            spec[seed] = vl.send([body(seed)])[0]
        for seed in range(3):
            assert len(_tokens(full[seed])) == TOKENS
            assert _tokens(spec[seed]) == _tokens(full[seed]), seed
        traces = [spec[s]["body"]["lynx"] for s in range(3)]
        assert sum(t["kept"] for t in traces) > 0, traces  # the anchor's drafts were worth keeping
        assert all(t["drafted"] >= t["kept"] for t in traces)

        # eight at once: what each returns alone
        bodies = [body(seed % 3) for seed in range(8)]
        together = vl.send(bodies)
        for seed, reply in zip(range(8), together):
            assert _tokens(reply) == _tokens(full[seed % 3])

        # a cache made from another prompt: that request fails, the engine goes on
        url = spec[0]["body"]["lynx"]["cache_url"]
        other = vl.send([
            {"prompt": _prompt(5), "max_tokens": 4, "temperature": 0, "cache_salt": "x1",
             "kv_transfer_params": {"lynx_url": url, "lynx_mode": "full"}}], url=vl.decode_url)[0]
        assert other["status"] != 200

        # a cache that never arrives (its residual is gone before anyone reads it): one error, within the timeout
        stop = threading.Event()
        before = set(os.listdir(store))
        dropper = threading.Thread(target=_drop_new, args=(store, before, stop), daemon=True)
        dropper.start()
        try:
            t0 = time.monotonic()
            lost = vl.send([body(7)])[0]
            took = time.monotonic() - t0
        finally:
            stop.set()
            dropper.join()
        assert lost["status"] == 502 and "lynxkv vllm-proxy:" in lost["body"]["error"]["message"], lost
        assert took < 30 + 60
        again = vl.send([body(1)])[0]
        assert _tokens(again) == _tokens(full[1])


def _drop_new(store, before: set, stop: threading.Event) -> None:
    """Delete every residual file the prefill writes from now on (the fault of a residual that never arrives)."""
    while not stop.is_set():
        for name in os.listdir(store):
            if name.endswith(".lynxr") and name not in before:
                try:
                    os.remove(os.path.join(store, name))
                except FileNotFoundError:
                    pass
        time.sleep(0.002)
