"""vLLM (CPU build) -> LMCacheMPConnector -> ``lmcache server`` with the lynx tier -> server restart -> a second
vLLM reuses the stored prefix; `lmcache://` reads it anchor first as the model's own layers and `lynxkv run` drafts
on it. ``make test-vllm`` (its own venv, marker ``vllm``; about 5-10 minutes on 2 cores).

The first engine finds nothing and stores the prompt's two 256-token chunks through the lynx serde (layout
``vllm-cpu-vec:32``: the engine's 32-token CPU attention blocks) and tier; the server is restarted (nothing in its
memory), and a second engine, a fresh process, retrieves both chunks from the lynx tier. Greedy output tokens are
identical with and without the stored prefix."""

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
    """2 layers x 2 KV heads x 32 head dim, saved with a word-level tokenizer (vLLM skips it; `lynxkv run` loads
    it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runner_helpers import save_tiny_model_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    save_tiny_model_dir(LlamaForCausalLM(cfg).eval(), path)


class Server:
    def __init__(self, tmp, port: int, http_port: int, n: int):
        spec = {"type": "plugin", "module_path": "lynxkv.integrations.lmcache.adapter", "class_name": "LynxL2Adapter",
                "adapter_params": {"anchor_path": str(tmp / "hot"), "residual_path": str(tmp / "cold")},
                "serde": {"type": "lynx", "kv_heads": 2, "layout": "vllm-cpu-vec:32"}}
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


def _json_of(cmd) -> dict:
    """The JSON document a command prints last on stdout."""
    p = subprocess.run(cmd, timeout=600, env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


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
    # loaded anchor first as one cache of the two chunks, bit-exact to each object's own full code, whose layers,
    # heads and head dim are the model's: its K and V are the model's own, to the code's precision
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
            assert (c.header.layers, c.header.kv_heads, c.header.head_dim) == (2, 2, 32)
            parts.append(c.load_kv(dtype=torch.float32))
    for layer, (k, v) in enumerate(full):
        assert torch.equal(k, torch.cat([p[layer][0] for p in parts], 1))
        assert torch.equal(v, torch.cat([p[layer][1] for p in parts], 1))

    # lynxkv's runner half, in fresh processes beside vLLM's transformers (< 5.20: lynxkv.hf.forward names the
    # cache as that version does): the load's K and V are the model's own (to the code's precision), and
    # `lynxkv run` drafts on the engine's store (anchors first on a 1 Mbit/s link, the residuals ~0.5 s later),
    # continues the whole prompt and gives plain decoding's tokens on the full code
    py = sys.executable
    ref = _json_of([py, "-c", REFERENCE, str(model), url, HERE])
    assert ref["max_error"] < 0.05, ref
    doc = _json_of([py, "-m", "lynxkv", "run", url, "-n", "16", "--ignore-eos", "--bandwidth", "1Mbps", "--json"])
    assert doc["token_ids"] == ref["want"] and doc["verified"] is True and doc["prompt_token_ids"] == PROMPT
    s = doc["stats"]
    assert s["drafted"] > 0 and s["anchor_ready_s"] <= s["residual_ready_s"]
    print(f"vLLM greedy {without}\nlynxkv run {doc['token_ids']}\nstats {json.dumps(s)}", file=sys.stderr)


REFERENCE = """
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from transformers import AutoModelForCausalLM
from lynxkv.hf import prefill
from lynxkv.speculative import decode_plain
from lynxkv.stream import open_progressive
from vllm_prefix_engine import PROMPT
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with open_progressive(sys.argv[2]) as load:
    full = load.residual.result(timeout=120)
exact, _ = prefill(model, torch.tensor(PROMPT[:512]))
err = max(float((a - b).abs().max()) for pair, ref in zip(full, exact) for a, b in zip(pair, ref))
want = decode_plain(model, full, PROMPT[:512], 16, new_token_ids=PROMPT[512:])
print(json.dumps({"max_error": err, "want": want}))
"""
