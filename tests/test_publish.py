"""Serving a cache while it is written (lynxkv.serve.publish, lynxkv.serve.publisher) on loopback: a reader gets
only final bytes and waits for the rest, a failed publisher or a wait past its bound cuts the response off, a tiny
model's prefill published while it runs reads back page for page as the saved tier copy, and the early reading of
an anchor's pages (lynxkv.stream.early) starts where the pages start."""

from __future__ import annotations

import http.client
import threading
import time

import pytest
import torch
from conftest import make_tiny_llama

from lynxkv.cache import open_cache
from lynxkv.format import constants as c
from lynxkv.quant.scheme import get_scheme
from lynxkv.serve.publish import GrowingFile, PublishServer
from lynxkv.serve.publisher import PrefillPublisher
from lynxkv.stream.early import lead_of
from lynxkv.stream.progressive import open_progressive

pytestmark = pytest.mark.network


def _get(server: PublishServer, path: str, first: int, last: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", "/" + path, headers={"Range": f"bytes={first}-{last}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _growing(size: int = 4096, lead: int = 128) -> GrowingFile:
    """A file whose first ``lead`` bytes are a hole (a header to come) and whose rest is written."""
    f = GrowingFile("anchor", "x.lynx", size)
    assert f.reserve(lead) == 0
    f.write(bytes(range(256)) * ((size - lead) // 256) + bytes((size - lead) % 256))
    return f


def test_written_bytes_are_served_at_once_and_a_hole_when_filled():
    f = _growing()
    with PublishServer([f], "00", port=0) as srv:
        assert _get(srv, "x.lynx", 128, 4095) == (206, bytes(f.data[128:]))
        header = bytes(range(128))
        timer = threading.Timer(0.4, f.fill, args=(0, header))
        t0 = time.perf_counter()
        timer.start()
        status, body = _get(srv, "x.lynx", 0, 4095)
        waited = time.perf_counter() - t0
        timer.join()
    assert status == 206 and body[:128] == header and body[128:] == bytes(f.data[128:])
    assert waited >= 0.35  # the response waited for the hole to be filled, it did not send zeros


@pytest.mark.parametrize("how", ["fail", "timeout"])
def test_a_failed_publisher_or_a_wait_past_its_bound_cuts_the_response_off(how):
    f = _growing()
    with PublishServer([f], "00", port=0, wait_timeout=0.5 if how == "timeout" else 30) as srv:
        if how == "fail":
            threading.Timer(0.3, f.fail, args=("the prefill died",)).start()
        t0 = time.perf_counter()
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            _get(srv, "x.lynx", 0, 4095)  # never a short 206 or the hole's zeros
        assert time.perf_counter() - t0 < 5
        if how == "timeout":  # the bytes that are final are still served
            assert _get(srv, "x.lynx", 128, 4095)[0] == 206
        else:  # a failed file serves nothing more
            with pytest.raises((http.client.HTTPException, ConnectionError)):
                _get(srv, "x.lynx", 128, 4095)


def test_a_fill_that_changes_bytes_already_served_fails_the_file():
    f = GrowingFile("anchor", "x.lynx", 200)
    f.provisional(0, b"A" * 100, 10)
    assert f.reserve(100) == 0
    f.write(bytes(100))
    with pytest.raises(Exception, match="changed"):
        f.fill(0, b"B" * 100)
    assert f.error is not None and not f.final_at(10, 100)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny Llama's prefill of 700 tokens published on loopback with a reader opened before the prefill ran."""
    out = tmp_path_factory.mktemp("pub") / "c.lynx"
    model = make_tiny_llama(4, layers=3, head_dim=32)
    ids = torch.randint(0, 128, (700,), generator=torch.Generator().manual_seed(3))
    pub = PrefillPublisher(model, ids, get_scheme("default"), name="c.lynx", out=str(out))
    with PublishServer(pub.files, pub.cache_id.hex(), port=0) as srv:
        early = _get(srv, "c.lynx", 0, c.ANCHOR_FIXED_SIZE - 1)  # the header's fixed part, before any page
        load = open_progressive(srv.url)
        try:
            time.sleep(0.3)  # the reader has asked for the header before the prefill starts
            report = pub.run()
            anchor_kv = [(k.clone(), v.clone()) for k, v in load.wait_anchor(30)]
            full_kv = load.residual.result(30)
        finally:
            load.close()
        served = _get(srv, "c.lynx", 0, pub.anchor.size - 1)[1], _get(srv, "c.lynxr", 0, pub.residual.size - 1)[1]
    return dict(out=out, early=early, report=report, anchor_kv=anchor_kv, full_kv=full_kv, served=served, ids=ids)


def test_a_prefill_published_while_it_runs_reads_back_as_the_saved_cache(published):
    out = published["out"]
    assert published["served"] == (out.read_bytes(), out.with_suffix(".lynxr").read_bytes())
    assert published["early"] == (206, out.read_bytes()[:c.ANCHOR_FIXED_SIZE])  # served early, and final
    r = published["report"]
    assert r.saved == [str(out.with_suffix(".lynxr")), str(out)]
    with open_cache(str(out)) as cache:
        assert cache.info.prompt_token_ids == published["ids"].tolist()
        for got, want in ((published["anchor_kv"], cache.load_kv(anchor_only=True, dtype=torch.float32)),
                          (published["full_kv"], cache.load_kv(dtype=torch.float32))):
            for (gk, gv), (wk, wv) in zip(got, want):
                assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_early_reading_starts_at_the_first_page(published):
    data = published["out"].read_bytes()
    with open_cache(str(published["out"])) as cache:
        h = cache.header
        first_page = h.segments[0].offset + c.PAGE_ENTRY_SIZE * h.layers * h.pages_per_layer
    assert lead_of(data[:c.ANCHOR_FIXED_SIZE], len(data)) == first_page
    assert lead_of(data[:c.ANCHOR_FIXED_SIZE], first_page - 1) is None  # claims past the file: nothing early
    assert lead_of(b"\0" * c.ANCHOR_FIXED_SIZE, len(data)) is None


def test_a_reader_waits_for_a_header_written_last_past_its_stall_bound(tmp_path):
    """The header and index of a cache being published come last: the reader waits for them (up to the publisher's
    own bound), not only its stall timeout, while the pages it has read ahead wait for them."""
    from lynxkv.cache import encode_kv
    from lynxkv.format.writer import build_files
    from lynxkv.storage import RetryPolicy

    kv = [(torch.randn(2, 300, 32), torch.randn(2, 300, 32)) for _ in range(2)]
    built = build_files(encode_kv(kv), residual_location="x.lynxr")
    lead, *pages = built.anchor_parts
    anchor, residual = GrowingFile("anchor", "x.lynx", len(built.anchor)), GrowingFile("residual", "x.lynxr",
                                                                                      len(built.residual))
    anchor.provisional(0, lead, c.ANCHOR_FIXED_SIZE)  # as a publisher serves it: the fixed part at once
    anchor.reserve(len(lead))
    for page in pages:
        anchor.write(page)
    residual.write(built.residual)
    with PublishServer([anchor, residual], "00", port=0) as srv:
        threading.Timer(2.0, anchor.fill, args=(0, lead)).start()
        load = open_progressive(srv.url, retry=RetryPolicy(attempts=2, stall_timeout=0.5))
        try:
            got = load.residual.result(30)
        finally:
            load.close()
    for (gk, gv), (wk, wv) in zip(got, encode_kv(kv).dequantize(dtype=torch.float32)):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_a_tier_that_cannot_be_written_fails_the_publish_and_its_readers(tmp_path):
    model = make_tiny_llama(4, layers=2, head_dim=16)
    pub = PrefillPublisher(model, torch.arange(100) % 128, get_scheme("default"), name="c.lynx",
                           out=str(tmp_path / "gone" / "c.lynx"))
    with pytest.raises(Exception, match="does not exist"):
        pub.run()
    assert pub.anchor.error and pub.residual.error  # every response waiting for their bytes is cut off
    assert not list(tmp_path.iterdir())


def test_a_published_cache_replaces_the_one_at_out_whole(tmp_path):
    """A second prefill to the same --out: the new residual under a fresh name (the old anchor keeps its own until
    it is replaced), the old residual removed afterwards; the cache there is the new one, whole."""
    model = make_tiny_llama(4, layers=2, head_dim=16)
    out = tmp_path / "c.lynx"
    ids = []
    for seed in (1, 2):
        pub = PrefillPublisher(model, torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(seed)),
                               get_scheme("default"), name="c.lynx", out=str(out))
        pub.run()
        ids.append(pub.cache_id)
    assert pub.residual.path != "c.lynxr"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.lynx", pub.residual.path])
    with open_cache(str(out)) as cache:
        assert cache.header.cache_id == ids[1]
        cache.load_kv()  # the residual it records is there and its own


@pytest.mark.parametrize("preset", ["default", "linear", "paper"])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_the_planned_layout_is_the_written_one(preset, tokens):
    """What a publisher serves before any page exists (sizes, offsets, the header's fixed part) is what the writer
    then writes, for every preset and page remainder."""
    from lynxkv.cache import encode_kv
    from lynxkv.format.writer import build_files, planned_framing

    kv = [(torch.randn(2, tokens, 32), torch.randn(2, tokens, 32)) for _ in range(3)]
    enc = encode_kv(kv, get_scheme(preset), prompt_token_ids=list(range(tokens)))
    cid = bytes(range(16))
    plan = planned_framing(enc, cache_id=cid, residual_location="x.lynxr")
    built = build_files(enc, cache_id=cid, residual_location="x.lynxr")
    a_seg, r_seg = plan.header.segments[:2]
    assert (a_seg.offset + a_seg.length, r_seg.length) == (len(built.anchor), len(built.residual))
    assert len(plan.anchor_lead) == len(built.anchor_parts[0])
    assert plan.anchor_lead[:c.ANCHOR_FIXED_SIZE] == built.anchor[:c.ANCHOR_FIXED_SIZE]
