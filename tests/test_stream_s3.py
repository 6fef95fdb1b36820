"""Tiers on a real S3-compatible server (moto's standalone HTTP server on loopback, reached through s3fs)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from fixtures_s3 import cache_bytes, kv_equal, random_kv, s3_server, write_pair  # noqa: F401 (fixture)

from lynxkv.cache import open_cache
from lynxkv.cli import main
from lynxkv.errors import ChecksumError, FormatError, LynxError
from lynxkv.storage import ALLOW_ENV, RetryPolicy, read_range, size_of, write_atomic
from lynxkv.stream import open_progressive

pytestmark = pytest.mark.network


@pytest.fixture(autouse=True)
def allow_the_bucket(s3_server, monkeypatch):
    """Caches here record residuals elsewhere in the bucket; the user allows the bucket (the trust rule)."""
    monkeypatch.setenv(ALLOW_ENV, f"s3://{s3_server.bucket}/")


def test_a_residual_url_is_not_followed_unless_allowed(tmp_path, s3_server, kv_ref, monkeypatch):
    kv, *_ = kv_ref
    rurl = s3_server.url("cold/refused.lynxr")
    anchor, residual = cache_bytes(kv, residual_location=rurl)
    write_atomic(rurl, residual)
    path = write_pair(tmp_path, anchor, None, name="refused")
    monkeypatch.delenv(ALLOW_ENV)
    with open_cache(path) as c:
        assert not c.residual_reachable()
        with pytest.raises(LynxError, match="--allow-location"):
            c.load_kv()
    with open_cache(path, allow_locations=[f"s3://{s3_server.bucket}/cold/"]) as c:
        assert c.residual_reachable()
    with open_cache(path, allow_locations=[f"s3://{s3_server.bucket}/co"]) as c:  # a prefix is a whole directory
        assert not c.residual_reachable()


@pytest.fixture(scope="module")
def kv_ref():
    kv = random_kv(layers=2, heads=2, tokens=520, dim=16, seed=3)
    anchor, residual = cache_bytes(kv, residual_location="x.lynxr")
    with open_cache(anchor, residual=residual) as c:
        return kv, anchor, residual, c.load_kv(anchor_only=True), c.load_kv()


def test_atomic_put_range_reads_and_sizes(s3_server):
    url = s3_server.url("t/blob.bin")
    data = os.urandom(300_000)
    write_atomic(url, data)
    assert size_of(url) == len(data)
    assert read_range(url, 1000, 5000) == data[1000:5000]
    with pytest.raises(LynxError, match="no such file"):
        size_of(s3_server.url("t/missing.bin"))


def test_anchor_local_residual_on_s3(tmp_path, s3_server, kv_ref):
    kv, _, _, ref_anchor, ref_full = kv_ref
    rurl = s3_server.url("cold/a.lynxr")
    anchor, residual = cache_bytes(kv, residual_location=rurl)
    write_atomic(rurl, residual)
    path = write_pair(tmp_path, anchor, None, name="a")
    with open_progressive(path, block_size=4096, inflight=4) as load:  # many ranged GETs, 4 in flight
        assert kv_equal(load.wait_anchor(60), ref_anchor)
        assert kv_equal(load.residual.result(60), ref_full)
        assert load.residual_url == rurl


def test_both_segments_on_s3_relative_location(s3_server, kv_ref):
    _, anchor, residual, ref_anchor, ref_full = kv_ref
    write_atomic(s3_server.url("hot/x.lynxr"), residual)
    write_atomic(s3_server.url("hot/x.lynx"), anchor)
    events = []
    with open_progressive(s3_server.url("hot/x.lynx"), on_event=events.append, block_size=8192) as load:
        assert kv_equal(load.residual.result(60), ref_full)
        assert kv_equal(load.wait_anchor(1), ref_anchor)
    kinds = [e.kind for e in events]
    assert kinds.index("anchor_ready") < kinds.index("residual_page")


def test_tier_moves_residual_to_s3_and_back(tmp_path, s3_server, kv_ref, capsys):
    _, anchor, residual, _, ref_full = kv_ref
    path = write_pair(tmp_path, anchor, residual)
    rurl = s3_server.url("tiered/x.lynxr")
    assert main(["tier", path, "--residual-out", rurl, "--json"]) == 0
    assert not os.path.exists(tmp_path / "x.lynxr")  # moved, not copied
    assert read_range(rurl, 0, len(residual)) == residual  # the residual itself is unchanged
    with open_cache(path) as c:
        assert c.info.residual_location == rurl
    with open_progressive(path) as load:
        assert kv_equal(load.residual.result(60), ref_full)
    # ... and the anchor to S3 too, next to its residual: the location becomes relative again.
    aurl = s3_server.url("tiered/x.lynx")
    assert main(["tier", path, aurl]) == 0
    assert not os.path.exists(path)
    with open_progressive(aurl) as load:
        assert kv_equal(load.residual.result(60), ref_full)
    # Back to local disk, both segments.
    back = str(tmp_path / "back" / "y.lynx")
    assert main(["tier", aurl, back, "--residual-out", str(tmp_path / "back" / "y.lynxr")]) == 0
    with open_cache(back) as c:
        assert c.info.residual_location == "y.lynxr"
        assert kv_equal(c.load_kv(), ref_full)
    capsys.readouterr()


def test_tier_refuses_a_corrupt_source(tmp_path, s3_server, kv_ref):
    _, anchor, residual, _, _ = kv_ref
    bad = bytearray(residual)
    bad[-10] ^= 1
    path = write_pair(tmp_path, anchor, bytes(bad))
    assert main(["tier", path, "--residual-out", s3_server.url("never/x.lynxr")]) == 1
    with pytest.raises(LynxError):
        size_of(s3_server.url("never/x.lynxr"))
    assert os.path.exists(tmp_path / "x.lynxr")  # nothing moved


def test_truncated_object_on_s3(tmp_path, s3_server, kv_ref):
    kv, _, _, ref_anchor, _ = kv_ref
    rurl = s3_server.url("trunc/x.lynxr")
    anchor, residual = cache_bytes(kv, residual_location=rurl)
    write_atomic(rurl, residual[: len(residual) // 2])
    path = write_pair(tmp_path, anchor, None)
    with open_progressive(path, allow_anchor_only=True) as load:
        with pytest.raises(FormatError, match="truncated"):
            load.residual.result(60)
        assert kv_equal(load.wait_anchor(60), ref_anchor)
        assert load.anchor_only


def test_corrupted_page_on_s3(tmp_path, s3_server, kv_ref):
    kv, _, _, _, _ = kv_ref
    rurl = s3_server.url("corrupt/x.lynxr")
    anchor, residual = cache_bytes(kv, residual_location=rurl)
    bad = bytearray(residual)
    bad[-5] ^= 0x10  # inside the last page of the last layer
    write_atomic(rurl, bytes(bad))
    path = write_pair(tmp_path, anchor, None)
    events = []
    with open_progressive(path, on_event=events.append, block_size=4096) as load:
        with pytest.raises(ChecksumError, match="residual layer 1 page 2"):
            load.residual.result(60)
    assert (1, 2) not in [(e.layer, e.page) for e in events if e.kind == "residual_page"]


def test_server_down_mid_stream_is_retried_then_reported(tmp_path, kv_ref):
    """An endpoint that refuses connections: transient errors are retried, then the load fails clearly."""
    kv, *_ = kv_ref
    from lynxkv.storage import filesystem  # noqa: F401 (s3fs must be importable)

    pytest.importorskip("s3fs")
    opts = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "config_kwargs": {
        "retries": {"max_attempts": 1}, "connect_timeout": 1}}
    anchor, _ = cache_bytes(kv, residual_location="s3://nowhere/x.lynxr")
    path = write_pair(tmp_path, anchor, None)
    with open_progressive(path, storage_options=opts, allow_anchor_only=True,
                          retry=RetryPolicy(attempts=2, base=0.01, stall_timeout=5)) as load:
        with pytest.raises(LynxError):
            load.residual.result(60)
        load.wait_anchor(60)
        assert load.timeline.residual_failed


def _kv_digest(kv) -> str:
    h = hashlib.sha256()
    for k, v in kv:
        h.update(k.numpy().tobytes())
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def test_a_new_process_opens_the_cache_from_its_tiers_with_only_the_path(tmp_path, s3_server, kv_ref):
    """Write a cache (anchor local, residual on S3); a separate Python process, given nothing but the anchor
    path (the endpoint comes from the environment, as for any fsspec user), loads it progressively."""
    kv, *_ = kv_ref
    rurl = s3_server.url("restart/x.lynxr")
    anchor, residual = cache_bytes(kv, residual_location=rurl)
    write_atomic(rurl, residual)
    path = write_pair(tmp_path, anchor, None)
    with open_cache(anchor, residual=residual) as c:
        expected = _kv_digest(c.load_kv())
    code = ("import sys, hashlib\n"
            "from lynxkv.stream import open_progressive\n"
            "load = open_progressive(sys.argv[1])\n"
            "kv = load.residual.result(120)\n"
            "h = hashlib.sha256()\n"
            "[h.update(t.numpy().tobytes()) for pair in kv for t in pair]\n"
            "print(h.hexdigest(), load.residual_url)\n"
            "load.close()\n")
    env = {**s3_server.env, ALLOW_ENV: f"s3://{s3_server.bucket}/"}
    proc = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    digest, where = proc.stdout.split()
    assert digest == expected and where == rurl
