"""The vLLM integration's parts that need no vLLM: the paged KV layouts, the decode side's shared loads over a
:class:`StoreServer`, and the proxy's request checks and verify rule (tests/test_vllm_proxy.py runs the whole path
on vLLM itself)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch

from lynxkv import open_cache, save_cache
from lynxkv.errors import InputError
from lynxkv.integrations.lmcache.chunk import ChunkLayout, kv_to_chunk
from lynxkv.integrations.vllm.fetch import LoadFailed, SharedLoads
from lynxkv.integrations.vllm.paged import gather, layout_of, scatter
from lynxkv.integrations.vllm.proxy import BadRequest, kept_prefix, parse
from lynxkv.serve.store import StoreServer

H, D, B = 2, 32, 32


def _kv(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, tokens, D, generator=g), torch.randn(H, tokens, D, generator=g)


@pytest.mark.parametrize("shape", [(9, H, B, 2 * D), (2, 9, B, H, D)], ids=["cpu", "flash"])
def test_a_request_s_tokens_go_to_its_own_slots_and_come_back(shape):
    layer = torch.zeros(shape)
    layout = layout_of(layer, block_size=B, kv_heads=H, head_dim=D)
    k, v = _kv(70)  # two whole blocks and part of a third
    scatter(layer, layout, [6, 1, 4], k, v)
    k2, v2 = gather(layer, layout, [6, 1, 4], 70)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    touched = (layer != 0).reshape(*shape[:2], -1).any(-1)
    blocks = touched.any(1) if len(shape) == 4 else touched.any(0)
    assert blocks.nonzero().flatten().tolist() == [1, 4, 6]  # nothing outside the request's blocks


def test_the_cpu_layout_is_the_one_lmcache_gathers_from_vllm():
    k, v = _kv(3 * B)
    layer = torch.zeros(3, H, B, 2 * D)
    scatter(layer, layout_of(layer, block_size=B, kv_heads=H, head_dim=D), [0, 1, 2], k, v)
    chunk = kv_to_chunk([(k, v)], torch.zeros(1, 3 * B, H * 2 * D), ChunkLayout("vllm-cpu-vec", B))
    per_block = chunk.view(1, 3, B, H, 2 * D)[0].permute(0, 2, 1, 3)  # [blocks, H, B, 2D]: each block's memory
    assert torch.equal(layer, per_block)


def test_a_paged_tensor_of_another_shape_is_refused():
    with pytest.raises(InputError, match="not a layout"):
        layout_of(torch.zeros(4, H, B, D), block_size=B, kv_heads=H, head_dim=D)
    layer = torch.zeros(2, H, B, 2 * D)
    with pytest.raises(InputError, match="blocks"):
        scatter(layer, layout_of(layer, block_size=B, kv_heads=H, head_dim=D), [0], *_kv(40))


@pytest.fixture
def store(tmp_path):
    kv = [_kv(100, seed) for seed in range(3)]
    save_cache(tmp_path / "r1.lynx", kv, prompt_token_ids=list(range(100)))
    with StoreServer(tmp_path) as srv:
        yield srv, tmp_path


@pytest.mark.network
def test_two_requests_for_one_cache_share_one_transfer_and_get_its_codes(store):
    srv, path = store
    opened = []

    def opener(url):
        from lynxkv.stream.progressive import open_progressive

        opened.append(url)
        return open_progressive(url)

    loads = SharedLoads(opener=opener)
    try:
        url = srv.url + "/r1.lynx"
        anchor = loads.kv(url, "anchor", list(range(90)), timeout=30)
        full = loads.kv(url, "full", list(range(90)), timeout=30)
        assert opened == [url]
        loads.kv(url, "anchor", list(range(90)), timeout=30)  # once the full code is taken, the load is gone
        assert opened == [url, url]
    finally:
        loads.close()
    with open_cache(str(path / "r1.lynx")) as c:
        want_full, want_anchor = c.load_kv(), c.load_kv(anchor_only=True)
    for (k, v), (wk, wv) in zip(full, want_full):
        assert torch.equal(k, wk[:, :90]) and torch.equal(v, wv[:, :90])
    for (k, v), (wk, wv) in zip(anchor, want_anchor):
        assert torch.equal(k, wk[:, :90]) and torch.equal(v, wv[:, :90])


@pytest.mark.network
def test_a_cache_of_another_prompt_or_none_at_all_fails_the_load(store):
    srv, _ = store
    loads = SharedLoads()
    try:
        with pytest.raises(LoadFailed, match="not made from the request's prompt"):
            loads.kv(srv.url + "/r1.lynx", "full", [5] * 50, timeout=30)
        with pytest.raises(LoadFailed):
            loads.kv(srv.url + "/nothing.lynx", "anchor", [1, 2], timeout=30)
        with pytest.raises(InputError, match="lynx_mode"):
            loads.kv(srv.url + "/r1.lynx", "exact", [1], timeout=30)
    finally:
        loads.close()


@pytest.mark.network
@pytest.mark.parametrize("path", ["/../r1.lynx", "/%2e%2e/etc/passwd", "/.hidden.lynx", "/r1.lynx/x", "/r1.txt"])
def test_the_store_serves_nothing_but_its_own_caches(store, path):
    srv, _ = store
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(srv.url + path, timeout=10)
    assert err.value.code == 404
    assert urllib.request.urlopen(srv.url + "/r1.lynxr", timeout=10).status == 200


@pytest.mark.parametrize("body, what", [
    ({"prompt": [], "temperature": 0}, "prompt"),
    ({"prompt": "hi", "temperature": 0.7}, "temperature"),
    ({"prompt": "hi", "temperature": 0, "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": 0, "lynx_mode": "exact"}, "lynx_mode"),
    ({"prompt": [1, -2], "temperature": 0}, "prompt"),
    ([1, 2], "object"),
])
def test_the_proxy_refuses_what_it_cannot_verify(body, what):
    with pytest.raises(BadRequest, match=what):
        parse(body)


def _rows(prompt_len: int, truth: list[int], other: int = 99) -> list:
    """``prompt_logprobs`` as vLLM returns them for prompt + drafts: at each draft position the drafted token with
    its rank, and the full code's argmax (``truth``) with rank 1."""
    rows: list = [None] + [{"0": {"logprob": 0.0, "rank": 0}}] * (prompt_len - 1)  # rows of cached positions
    for tok in truth:
        rows.append({str(tok): {"logprob": -0.1, "rank": 1}, str(other): {"logprob": -3.0, "rank": 7}})
    return rows


@pytest.mark.parametrize("drafts, kept", [([7, 8, 9, 1], 4), ([7, 8, 5, 1], 2), ([7, 3], 1), ([7], 1)])
def test_the_proxy_keeps_the_drafts_the_full_code_agrees_with_up_to_the_first_that_it_does_not(drafts, kept):
    truth = [7, 8, 9, 1, 4]
    rows = _rows(3, truth)
    for j, d in enumerate(drafts):  # the drafted token's own entry at its position
        rows[3 + j] = {**rows[3 + j], str(d): rows[3 + j].get(str(d), {"logprob": -2.0, "rank": 5})}
    assert kept_prefix(drafts, rows[:3 + len(drafts)], 3) == kept


def test_rows_missing_or_malformed_keep_nothing_more():
    assert kept_prefix([7, 8, 9], None, 3) == 1
    assert kept_prefix([7, 8, 9], [None, None, None, None, {"8": "rank 1"}], 3) == 1
