"""vLLM (CPU build) -> LMCacheMPConnector -> ``lmcache server`` with the lynx tier -> server restart -> a second
vLLM reuses the stored prefix, and `lmcache://` reads it anchor first. ``make test-vllm`` (its own venv, marker ``vllm``; about 5 minutes on 2 cores).

The first engine finds nothing and stores the prompt's two 256-token chunks through the lynx serde and tier; the
server is restarted (nothing in its memory), and a second engine, a fresh process, retrieves both chunks from the
lynx tier. Greedy output tokens are identical with and without the stored prefix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.lmcache]
pytest.importorskip("vllm", reason="vLLM is not installed here: run `make test-vllm`")
pytest.importorskip("lmcache", reason="LMCache is not installed here: run `make test-vllm`")

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "VLLM_NO_USAGE_STATS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_llama(path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(path)


class Server:
    def __init__(self, tmp, port: int, http_port: int, n: int):
        spec = {"type": "plugin", "module_path": "lynxkv.integrations.lmcache.adapter", "class_name": "LynxL2Adapter",
                "adapter_params": {"anchor_path": str(tmp / "hot"), "residual_path": str(tmp / "cold")},
                "serde": {"type": "lynx", "kv_heads": 2}}
        self.log_path = tmp / f"server{n}.log"
        self.log = open(self.log_path, "w")
        exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
        self.proc = subprocess.Popen([exe, "server", "--host", "127.0.0.1", "--port", str(port), "--http-port",
                                      str(http_port), "--l1-size-gb", "0.2", "--eviction-policy", "LRU",
                                      "--supported-transfer-mode", "auto", "--l2-adapter", json.dumps(spec)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=ENV)
        t0 = time.monotonic()
        while "cache server is running" not in self.text():
            assert self.proc.poll() is None and time.monotonic() - t0 < 180, self.text()[-3000:]
            time.sleep(0.5)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def _generate(model, port: int, out) -> list[int]:
    subprocess.run([sys.executable, os.path.join(HERE, "vllm_prefix_engine.py"), str(model), str(port), str(out)],
                   check=True, timeout=600, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["tokens"]


def test_a_second_vllm_reuses_the_prefix_from_the_lynx_tier_after_a_server_restart(tmp_path):
    model = tmp_path / "model"
    _tiny_llama(model)
    port, http_port = _free_port(), _free_port()
    srv = Server(tmp_path, port, http_port, 1)
    try:
        without = _generate(model, port, tmp_path / "out1.json")
        t0 = time.monotonic()
        while "lynx tier: stored" not in srv.text() and time.monotonic() - t0 < 120:
            time.sleep(0.5)  # LMCache moves chunks from its L1 to the L2 tier asynchronously
        stored = srv.text()
    finally:
        srv.stop()
    assert "lynx tier: stored 2 chunks" in stored, stored[-3000:]
    anchors, residuals = os.listdir(tmp_path / "hot"), os.listdir(tmp_path / "cold")
    assert len(anchors) == len(residuals) == 2
    srv = Server(tmp_path, port, http_port, 2)  # a new server process: only the lynx tier's files remain
    try:
        with_prefix = _generate(model, port, tmp_path / "out2.json")
        retrieved = srv.text()
    finally:
        srv.stop()
    assert "lynx tier: retrieved 2 of 2 chunks" in retrieved, retrieved[-3000:]
    assert "Retrieved 512 tokens" in retrieved
    assert len(without) == 16 and with_prefix == without
    from lynxkv.cache import verify_file

    for a in anchors:
        assert verify_file(str(tmp_path / "hot" / a), allow_locations=(str(tmp_path / "cold"),)) == []

    # the lynx runner's view of the same store: the prompt's ids address the engine's objects (LMCache's keys),
    # loaded anchor first as one cache of the two chunks, bit-exact to each object's own full code
    import torch

    from lynxkv.cache import open_cache
    from lynxkv.stream import open_progressive
    from vllm_prefix_engine import PROMPT

    url = (f"lmcache://{model}?anchor_path={tmp_path / 'hot'}&residual_path={tmp_path / 'cold'}"
           f"&tokens={','.join(map(str, PROMPT))}")
    with open_progressive(url) as load:
        full = load.residual.result(timeout=120)
        assert load.timeline.extra["lmcache"]["chunks"] == 2 and load.prompt_token_ids == PROMPT[:512]
        names = load.timeline.extra["lmcache"]["objects"]
    parts = []
    for name in names:
        with open_cache(str(tmp_path / "hot" / name), residual=str(tmp_path / "cold" / (name + "r"))) as c:
            parts.append(c.load_kv(dtype=torch.float32))
    for layer, (k, v) in enumerate(full):
        assert torch.equal(k, torch.cat([p[layer][0] for p in parts], 1))
        assert torch.equal(v, torch.cat([p[layer][1] for p in parts], 1))
