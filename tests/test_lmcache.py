"""The lynx serde and storage tier inside LMCache 0.5.6 (``make test-lmcache``: its own venv, marker ``lmcache``).

Everything goes through LMCache's own machinery: the serde is built by ``create_serde_processor`` from the config
dict a tier carries, the tier by LMCache's plugin loader from ``{"type": "plugin", "module_path": ...}``, the
buffers are LMCache ``TensorMemoryObj``s; ``lmcache server`` is started with the README's command line. CPU,
loopback, no model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.lmcache
lmcache = pytest.importorskip("lmcache", reason="LMCache is not installed here: run `make test-lmcache`")
os.environ["LMCACHE_TRACK_USAGE"] = "false"

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: E402
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from lynxkv.cache import open_cache, verify_file  # noqa: E402
from lynxkv.errors import LynxError  # noqa: E402
from fixtures_s3 import s3_server  # noqa: E402,F401  (a fixture: moto's S3 server on loopback)
from lynxkv.cli import main  # noqa: E402

MODEL = "org/tiny-llama"
SHAPE = (2, 3, 256, 2 * 32)  # [K/V, layers, tokens, kv_heads * head_dim]


SERDE = {"kv_heads": 2}


def tier_spec(hot, cold, serde: dict = SERDE, **params) -> dict:
    return {"type": "plugin", "module_path": "lynxkv.integrations.lmcache.adapter", "class_name": "LynxL2Adapter",
            "adapter_params": {"anchor_path": str(hot), "residual_path": str(cold), **params},
            "serde": {"type": "lynx", **serde}}


def memobj(tensor: torch.Tensor) -> TensorMemoryObj:
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    return TensorMemoryObj(raw, MemoryObjMetadata(tensor.shape, tensor.dtype, 0, raw.numel(), 1), None)


def wait(poll, timeout=30.0):
    t0 = time.monotonic()
    while (r := poll()) is None or r == {}:
        assert time.monotonic() - t0 < timeout, "LMCache task did not complete"
        time.sleep(0.01)
    return r


class Tier:
    """The lynx tier and its serde as LMCache builds them from a tier spec, for chunks of ``shape`` and ``dtype``."""

    def __init__(self, hot, cold, serde: dict = SERDE, shape=SHAPE, dtype=torch.float16, **params):
        spec = tier_spec(hot, cold, serde, **params)
        self.adapter = create_l2_adapter_from_registry(PluginL2AdapterConfig.from_dict(spec))
        self.serde = create_serde_processor(SerdeConfig("lynx", dict(serde)))
        self.shape, self.dtype = shape, dtype
        self.size = self.serde.estimate_serialized_size(MemoryLayoutDesc([torch.Size(shape)], [dtype]))

    def store(self, keys, chunks) -> None:
        temps = [memobj(torch.zeros(self.size, dtype=torch.uint8)) for _ in keys]
        tid = self.serde.submit_serialize([memobj(c) for c in chunks], temps, keys)
        assert wait(lambda: self.serde.query_serialize_result(tid)) is True
        tid = self.adapter.submit_store_task(keys, temps)
        assert wait(self.adapter.pop_completed_store_tasks)[tid].is_successful()

    def lookup(self, keys) -> list[int]:
        tid = self.adapter.submit_lookup_and_lock_task(keys, {})
        return wait(lambda: self.adapter.query_lookup_and_lock_result(tid)).get_indices_list()

    def retrieve(self, keys) -> list[torch.Tensor | None]:
        temps = [memobj(torch.zeros(self.size, dtype=torch.uint8)) for _ in keys]
        tid = self.adapter.submit_load_task(keys, temps)
        hits = wait(lambda: self.adapter.query_load_result(tid)).get_indices_list()
        outs: list = [None] * len(keys)
        if hits:
            dsts = [memobj(torch.zeros(self.shape, dtype=self.dtype)) for _ in hits]
            sid = self.serde.submit_deserialize([temps[i] for i in hits], dsts, [keys[i] for i in hits])
            assert wait(lambda: self.serde.query_deserialize_result(sid)) is True
            for i, d in zip(hits, dsts):
                outs[i] = d.tensor.clone()
        return outs

    def close(self) -> None:
        self.adapter.close()
        self.serde.close()


def chunks(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(SHAPE, generator=g).to(torch.float16) for _ in range(n)]


def keys(n: int) -> list[ObjectKey]:
    return [ObjectKey(bytes([i + 1]) * 8, MODEL, 0) for i in range(n)]


def full_code(hot, cold, key) -> torch.Tensor:
    """What lynxkv itself decodes from the two stored objects, laid out as the chunk."""
    from lynxkv.integrations.lmcache.adapter import object_name

    name = object_name(key)
    with open_cache(os.path.join(hot, name + ".lynx"), residual=os.path.join(cold, name + ".lynxr")) as c:
        kv = c.load_kv(dtype=torch.float16)
    return torch.stack([torch.stack([x.permute(1, 0, 2).reshape(SHAPE[2], -1) for x in pair]) for pair in kv], 1)


STORE_THEN_EXIT = """
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_lmcache import Tier, chunks, keys
t = Tier(sys.argv[1], sys.argv[2]); t.store(keys(3), chunks(3)); t.close()
"""


def test_store_in_one_process_retrieve_in_another_bit_exact(tmp_path):
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    here = os.path.dirname(__file__)
    subprocess.run([sys.executable, "-c", STORE_THEN_EXIT, str(hot), str(cold), here], check=True, timeout=120,
                   env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
    tier = Tier(hot, cold)  # a fresh process's view: nothing in memory, only the two directories
    try:
        ks = keys(3) + [ObjectKey(b"\xee" * 8, MODEL, 0), ObjectKey(bytes([1]) * 8, "other/model", 0)]
        assert tier.lookup(ks) == [0, 1, 2]  # the model name is part of the key
        got = tier.retrieve(ks)
    finally:
        tier.close()
    assert got[3] is None and got[4] is None
    for key, x, y in zip(keys(3), chunks(3), got):
        assert torch.equal(y, full_code(str(hot), str(cold), key))  # bit-exact to the full code
        assert (y.float() - x.float()).abs().max() < 0.05
    anchors, residuals = sorted(os.listdir(hot)), sorted(os.listdir(cold))
    assert len(anchors) == len(residuals) == 3 and all(a.startswith("org%2Ftiny-llama@") for a in anchors)
    on_disk = sum(os.path.getsize(hot / a) for a in anchors) + sum(os.path.getsize(cold / r) for r in residuals)
    fp16 = 3 * torch.Size(SHAPE).numel() * 2
    assert on_disk <= 0.6 * fp16, (on_disk, fp16)


def test_stored_objects_are_lynx_segments_verify_and_inspect_read(tmp_path, capsys):
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    tier = Tier(hot, cold)
    try:
        tier.store(keys(1), chunks(1))
    finally:
        tier.close()
    anchor = str(hot / os.listdir(hot)[0])
    residual = str(cold / os.listdir(cold)[0])
    # the anchor records its residual relative to itself (../cold/...): outside its directory, so the trust rule
    # wants the residual tier allowed
    assert verify_file(anchor, allow_locations=(str(cold),)) == []
    assert main(["verify", anchor, "--allow-location", str(cold), "--json"]) == 0
    capsys.readouterr()
    os.rename(residual, residual + ".away")  # the anchor alone: inspect and an anchor-only decode
    assert main(["inspect", anchor, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_heads"] == 2 and info["tokens"] == 256
    with open_cache(anchor) as c:
        approx = c.load_kv(anchor_only=True)
    assert len(approx) == SHAPE[1]


def test_a_vllm_cpu_chunk_through_the_serde_is_stored_as_the_models_layers_and_retrieved_bit_exact(tmp_path):
    """vLLM's CPU build registers a fused object ``[layers, tokens, kv_heads * 2 * head_dim]`` (fp32 here) whose
    32-token blocks are its attention kernel's raw memory; with ``layout`` the stored object is a cache of the
    model's 3 layers x 2 heads x 32, and the engine gets its layout back, bit-exact to that cache's full code."""
    from test_lmcache_chunk import _vllm_cpu_object

    from lynxkv.integrations.lmcache.chunk import kv_to_chunk, parse_layout

    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(2, 3, 2, 256, 32, generator=g)
    engine = _vllm_cpu_object(k, v, 32)  # what LMCache gathers from the engine's paged cache
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    tier = Tier(hot, cold, {**SERDE, "layout": "vllm-cpu-vec:32"}, tuple(engine.shape), torch.float32)
    try:
        tier.store(keys(1), [engine])
        (got,) = tier.retrieve(keys(1))
    finally:
        tier.close()
    name = os.listdir(hot)[0]
    with open_cache(str(hot / name), residual=str(cold / (name + "r"))) as c:
        assert (c.header.layers, c.header.kv_heads, c.header.tokens, c.header.head_dim) == (3, 2, 256, 32)
        full = c.load_kv(dtype=torch.float32)
    for layer, (fk, fv) in enumerate(full):  # the model's own keys and values, to the code's precision
        assert (fk - k[layer]).abs().max() < 0.05 and (fv - v[layer]).abs().max() < 0.05
    assert torch.equal(got, kv_to_chunk(full, torch.empty_like(engine), parse_layout("vllm-cpu-vec:32")))
    on_disk = os.path.getsize(hot / name) + os.path.getsize(cold / (name + "r"))
    assert on_disk <= 0.6 * engine.numel() * 2, on_disk  # <= 0.6x the fp16 size of the same KV


def test_a_corrupted_object_is_a_miss_for_that_chunk_only(tmp_path):
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    tier = Tier(hot, cold)
    try:
        ks = keys(3)
        tier.store(ks, chunks(3))
        from lynxkv.integrations.lmcache.adapter import object_name

        a = hot / (object_name(ks[0]) + ".lynx")
        data = bytearray(a.read_bytes())
        data[-3] ^= 0x01  # an anchor page
        a.write_bytes(bytes(data))
        r = cold / (object_name(ks[2]) + ".lynxr")
        data = bytearray(r.read_bytes())
        data[200] ^= 0x80  # a residual page
        r.write_bytes(bytes(data))
        got = tier.retrieve(ks)
    finally:
        tier.close()
    assert got[0] is None and got[2] is None  # misses, never data
    assert torch.equal(got[1], full_code(str(hot), str(cold), ks[1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_exact_chunks_are_stored_as_a_third_file_and_retrieved_bit_for_bit(tmp_path, dtype):
    """Format 1.4: with ``exact`` in the serde each object carries the chunk's exact segment; the tier keeps it in
    its own file on ``exact_path`` and checks it (CRCs, rebuild) on every load; the chunk comes back bit for bit.
    A corrupt or missing exact file is a miss for that chunk only."""
    hot, cold, arch = tmp_path / "hot", tmp_path / "cold", tmp_path / "archive"
    tier = Tier(hot, cold, {**SERDE, "exact": True}, dtype=dtype, exact_path=str(arch), exact=True)
    xs = [x.to(dtype) for x in chunks(3)]
    try:
        ks = keys(3)
        tier.store(ks, xs)
        from lynxkv.integrations.lmcache.adapter import object_name

        names = [object_name(k) for k in ks]
        assert sorted(os.listdir(arch)) == sorted(n + ".lynxe" for n in names)
        assert tier.lookup(ks) == [0, 1, 2]
        got = tier.retrieve(ks)
        for x, y in zip(xs, got):
            assert y.dtype == dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))  # bit for bit
        assert not torch.equal(full_code(str(hot), str(cold), ks[0]).to(dtype).view(torch.uint8),
                               xs[0].view(torch.uint8))  # which the full code is not
        e = arch / (names[0] + ".lynxe")
        data = bytearray(e.read_bytes())
        data[-3] ^= 0x20  # an exact page
        e.write_bytes(bytes(data))
        (arch / (names[2] + ".lynxe")).unlink()
        assert tier.lookup(ks) == [0, 1]  # "exact": true wants the exact file too
        got = tier.retrieve(ks)
    finally:
        tier.close()
    assert got[0] is None and got[2] is None  # misses, never data
    assert torch.equal(got[1].view(torch.uint8), xs[1].view(torch.uint8))


@pytest.mark.parametrize("value", ["false", "0", "no"])
def test_exact_false_as_a_string_does_not_make_lookups_want_an_exact_file(tmp_path, value):
    """``"exact"`` in the adapter's parameters is read as the serde reads it: the string "false" is false, so
    chunks stored without an exact segment are hits."""
    tier = Tier(tmp_path / "hot", tmp_path / "cold", exact=value)
    try:
        ks = keys(2)
        tier.store(ks, chunks(2))
        assert tier.lookup(ks) == [0, 1]
    finally:
        tier.close()
    with pytest.raises(LynxError, match="exact"):
        Tier(tmp_path / "hot", tmp_path / "cold", exact="maybe")


def test_lmcache_server_runs_with_the_lynx_tier(tmp_path):
    """The README's command line: the server starts, loads the plugin tier and its serde, and serves."""
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cmd = ["lmcache", "server", "--host", "127.0.0.1", "--port", str(ports[0]), "--http-port", str(ports[1]),
           "--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
           "--l2-adapter", json.dumps(tier_spec(tmp_path / "hot", tmp_path / "cold"))]
    exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([exe] + cmd[1:], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"})
    try:
        t0 = time.monotonic()
        text = ""
        while "cache server is running" not in text:
            assert proc.poll() is None, text[-3000:]
            assert time.monotonic() - t0 < 120, text[-3000:]
            time.sleep(0.5)
            log.seek(0)
            text = log.read()
        assert "lynx tier: anchors in" in text
        assert (tmp_path / "hot").is_dir() and (tmp_path / "cold").is_dir()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


# ------------------------------------------------------------------------------------------ lmcache:// reads
def lmcache_keys(tokens: list[int], model: str = MODEL) -> list[ObjectKey]:
    """The keys `lmcache server` gives these tokens (its resolver and token hasher; one rank, group 0)."""
    from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    return resolve_object_keys(TokenHasher(), model, 1, tokens, "")[0]


def prompt(n_tokens: int, seed: int = 5) -> list[int]:
    return torch.randint(0, 50_000, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def store_prompt(hot, cold, tokens: list[int]) -> list[ObjectKey]:
    ks = lmcache_keys(tokens)
    tier = Tier(hot, cold)
    try:
        tier.store(ks, chunks(len(ks)))
    finally:
        tier.close()
    return ks


def url_of(hot, tokens, model: str = MODEL, **params) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"anchor_path": hot, **params}.items())
    return f"lmcache://{model}?{query}&tokens={','.join(map(str, tokens))}"


def stored_kv(hot, cold, ks, *, anchor_only=False):
    """What lynxkv decodes from each stored chunk on its own, joined along tokens ([H, T, D] per layer)."""
    from lynxkv.integrations.lmcache.source import object_paths

    per_chunk = []
    for key in ks:
        a, r = object_paths(key, str(hot), str(cold))
        with open_cache(a, residual=r) as c:
            per_chunk.append(c.load_kv(anchor_only=anchor_only, dtype=torch.float32))
    return [tuple(torch.cat([kv[layer][i] for kv in per_chunk], dim=1) for i in range(2))
            for layer in range(SHAPE[1])]


def assert_same_kv(got, want):
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_a_stored_prefix_streams_anchor_first_bit_exact(tmp_path, capsys):
    from lynxkv.stream import open_progressive

    hot, cold = tmp_path / "hot", tmp_path / "cold"
    tokens = prompt(3 * 256 + 40)  # three complete chunks; the 40 tokens after them are never stored
    ks = store_prompt(hot, cold, tokens)
    assert len(ks) == 3
    url = url_of(hot, tokens, residual_path=cold)
    events = []
    with open_progressive(url, on_event=events.append) as load:
        anchor_kv = load.wait_anchor(timeout=60)
        full_kv = load.residual.result(timeout=60)
        assert load.prompt_token_ids == tokens[:768]
        info = load.timeline.extra["lmcache"]
    assert (info["chunks"], info["chunks_requested"], info["tokens"], info["miss"]) == (3, 3, 768, None)
    kinds = [e.kind for e in events]
    assert kinds.count("anchor_page") == kinds.count("residual_page") == 3 * SHAPE[1]
    assert max(i for i, k in enumerate(kinds) if k == "anchor_page") < kinds.index("anchor_ready") \
        < min(i for i, k in enumerate(kinds) if k == "residual_page")
    assert_same_kv(full_kv, stored_kv(hot, cold, ks))  # bit-exact to the full code of every chunk
    assert_same_kv(anchor_kv, stored_kv(hot, cold, ks, anchor_only=True))

    # the CLI: a streamed copy of the prefix is one cache that verifies and decodes to the same KV
    copy = tmp_path / "copy" / "prefix.lynx"
    assert main(["stream", url, "-o", str(copy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["anchor_bytes"] + report["residual_bytes"] == sum(
        os.path.getsize(p) for p in (copy.parent).iterdir())
    assert main(["verify", str(copy)]) == 0
    with open_cache(copy) as c:
        assert list(c.header.prompt_token_ids) == tokens[:768]
        assert_same_kv(c.load_kv(dtype=torch.float32), full_kv)

    # the trust rule: without residual_path each anchor's recorded residual (../cold/...) must be allowed
    with open_progressive(url_of(hot, tokens)) as load:
        with pytest.raises(LynxError, match="allow-location"):
            load.wait_anchor(timeout=60)
    with open_progressive(url_of(hot, tokens), allow_locations=(str(cold),)) as load:
        assert_same_kv(load.residual.result(timeout=60), full_kv)


def test_a_damaged_chunk_ends_the_prefix_or_fails_the_load_never_data(tmp_path):
    import shutil

    from lynxkv.errors import InputError, LynxError
    from lynxkv.stream import open_progressive
    from lynxkv.integrations.lmcache.source import object_paths

    hot, cold = tmp_path / "hot", tmp_path / "cold"
    tokens = prompt(3 * 256)
    ks = store_prompt(hot, cold, tokens)
    whole = stored_kv(hot, cold, ks)

    def damaged(case: str, key: ObjectKey, which: int, at: int):
        """A copy of the store with one byte of one object flipped; returns its URL."""
        h2, c2 = tmp_path / case / "hot", tmp_path / case / "cold"
        shutil.copytree(hot, h2)
        shutil.copytree(cold, c2)
        path = object_paths(key, str(h2), str(c2))[which]
        data = bytearray(open(path, "rb").read())
        data[at] ^= 0x01
        open(path, "wb").write(bytes(data))
        return url_of(h2, tokens, residual_path=c2)

    # a damaged header (caught before streaming): the prefix ends before that chunk, and says why
    with open_progressive(damaged("header", ks[1], 0, 30)) as load:
        kv = load.residual.result(timeout=60)
        assert load.prompt_token_ids == tokens[:256]
        info = load.timeline.extra["lmcache"]
    assert info["chunks"] == 1 and info["miss"].startswith("chunk 1 (") and "crc" in info["miss"].lower()
    assert_same_kv(kv, [(k[:, :256], v[:, :256]) for k, v in whole])

    # a damaged anchor page (found while streaming): the load fails with one error naming the page
    with open_progressive(damaged("anchor-page", ks[2], 0, -3)) as load:
        with pytest.raises(LynxError, match="anchor layer 2 page 2"):
            load.wait_anchor(timeout=60)

    # a damaged residual page: the residual fails; the anchor survives only when allowed, flagged
    url = damaged("residual-page", ks[0], 1, -3)
    with open_progressive(url) as load:
        with pytest.raises(LynxError, match="residual layer 2 page 0"):
            load.residual.result(timeout=60)
    with open_progressive(url, allow_anchor_only=True) as load:
        assert_same_kv(load.wait_anchor(timeout=60), stored_kv(hot, cold, ks, anchor_only=True))
        with pytest.raises(LynxError):
            load.residual.result(timeout=60)
        assert load.anchor_only

    # another chunk's objects under chunk 1's names: a miss (the cache id binds an object to its key)
    for src, dst in zip(object_paths(ks[0], str(hot), str(cold)), object_paths(ks[1], str(hot), str(cold))):
        shutil.copyfile(src, dst)
    with open_progressive(url_of(hot, tokens, residual_path=cold)) as load:
        load.residual.result(timeout=60)
        assert load.timeline.extra["lmcache"]["chunks"] == 1
        assert "another chunk's cache id" in load.timeline.extra["lmcache"]["miss"]

    # a valid object bound to chunk 1's key but holding 128 tokens: a miss (pages are joined, never re-cut)
    from lynxkv.integrations.lmcache.chunk import encode_chunk, split_chunk
    from lynxkv.integrations.lmcache.source import key_cache_id

    a1, r1 = object_paths(ks[1], str(hot), str(cold))
    single = encode_chunk(torch.zeros(2, SHAPE[1], 128, SHAPE[3]), kv_heads=2, model_name=MODEL,
                          cache_id=key_cache_id(ks[1]))
    anchor, residual = split_chunk(single, os.path.relpath(r1, os.path.dirname(a1)))
    open(r1, "wb").write(residual)
    open(a1, "wb").write(anchor)
    with open_progressive(url_of(hot, tokens, residual_path=cold)) as load:
        load.residual.result(timeout=60)
        assert load.timeline.extra["lmcache"]["miss"].endswith("128 tokens, the chunk size is 256")

    # nothing stored for these tokens: one clear error
    with open_progressive(url_of(hot, prompt(512, seed=9), residual_path=cold)) as load:
        with pytest.raises(InputError, match="no stored prefix of these tokens"):
            load.wait_anchor(timeout=60)


def test_lynxkv_run_drafts_on_a_stored_prefix_and_equals_full_code_decoding(tmp_path, capsys):
    """An engine's KV of a prompt stored through the tier (model name = the model directory, as vLLM's --model);
    `lynxkv run lmcache://...` continues the whole prompt: the stored prefix loads anchor first, the tokens after
    it are prefilled on the anchor, and the output equals plain decoding on the full code."""
    from conftest import make_tiny_llama
    from runner_helpers import prompt_ids, save_tiny_model_dir

    from lynxkv.hf import prefill
    from lynxkv.speculative import decode_plain

    model = make_tiny_llama(4, layers=SHAPE[1], head_dim=32)  # 2 KV heads x 32: the chunk shape of this file
    model_dir = save_tiny_model_dir(model, tmp_path / "model")
    ids = prompt_ids(4, 2 * 256 + 20)
    kv, _ = prefill(model, torch.tensor(ids[:512]))  # what the engine computed for the two complete chunks
    engine_chunks = [torch.stack([torch.stack([x[:, s:s + 256].permute(1, 0, 2).reshape(256, -1) for x in pair])
                                  for pair in kv], 1) for s in (0, 256)]
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    ks = lmcache_keys(ids, model_dir)
    tier = Tier(hot, cold)
    try:
        tier.store(ks, engine_chunks)
    finally:
        tier.close()
    url = url_of(hot, ids, model_dir, residual_path=cold)
    assert main(["run", url, "-n", "12", "--ignore-eos", "--bandwidth", "2MB/s", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = decode_plain(model, stored_kv(hot, cold, ks), ids[:512], 12, new_token_ids=ids[512:])
    assert doc["token_ids"] == want and doc["verified"] is True
    assert doc["prompt_token_ids"] == ids
    s = doc["stats"]
    assert s["anchor_ready_s"] < s["residual_ready_s"] and s["load"]["anchor_bytes"] > 0
    assert main(["run", url, "--model", "org/another", "-n", "4"]) == 1  # the store's keys name another model
    assert "made with model" in capsys.readouterr().err



def test_anchors_on_local_disk_residuals_on_s3(tmp_path, s3_server):
    """The issue's tiering: the tier keeps anchors in a local directory and residuals on S3 (moto on loopback,
    real HTTP); lmcache:// reads the anchors from disk first, then the residuals with ranged GETs."""
    from lynxkv.stream import open_progressive

    hot, cold = tmp_path / "hot", s3_server.url("lynx-residuals")
    tokens = prompt(2 * 256, seed=11)
    ks = store_prompt(hot, cold, tokens)
    assert len(s3_server.fs().ls(f"{s3_server.bucket}/lynx-residuals")) == 2
    with open_progressive(url_of(hot, tokens, residual_path=cold)) as load:
        kv = load.residual.result(timeout=120)
        assert load.residual_url == cold
    assert_same_kv(kv, stored_kv(hot, cold, ks))
    # the anchors record their residuals' URLs: followed only when allowed
    with open_progressive(url_of(hot, tokens), allow_locations=(cold,)) as load:
        assert_same_kv(load.residual.result(timeout=120), kv)
