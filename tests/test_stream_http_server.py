"""``lynxkv serve`` over HTTP on loopback: byte-identical copies, ranges, DSCP marks, priority, and the attacks a
public server meets (an idle anchor reader, idle connections, many clients, drops, malformed requests)."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from fixtures_s3 import cache_bytes, kv_equal, random_kv, synthetic_cache_bytes, write_pair

from lynxkv.cache import open_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import LynxError
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream import open_progressive
from lynxkv.serve import CacheServer, load_served_cache, parse_dscp
from lynxkv.serve.connections import EVICT_AFTER

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("http")
    kv = random_kv(layers=2, heads=2, tokens=700, dim=16, seed=5)
    anchor, residual = cache_bytes(kv, residual_location="x.lynxr")
    path = write_pair(d, anchor, residual)
    with open_cache(path) as c:
        return path, anchor, residual, c.load_kv(anchor_only=True), c.load_kv()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """~19 MB: 0.75 s at 200 Mbit/s, long enough that connection set-up does not decide the ratio."""
    d = tmp_path_factory.mktemp("big")
    anchor, residual = synthetic_cache_bytes(layers=4, heads=8, tokens=2048, dim=128)
    return write_pair(d, anchor, residual), anchor, residual


def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def fetch_all(srv: CacheServer) -> tuple[bytes, bytes]:
    res = srv.cache.residual
    return get(srv.url)[2], get(f"{srv.base_url}/{res.path}")[2] if res else b""


def test_serve_to_stream_writes_a_byte_identical_verified_cache(tmp_path, cache, capsys):
    path, anchor, residual, _, _ = cache
    with CacheServer(load_served_cache(path), bandwidth=20e6) as srv:
        dest = str(tmp_path / "got" / "copy.lynx")
        assert main(["stream", srv.url, "-o", dest, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert open(dest, "rb").read() == anchor
    assert open(tmp_path / "got" / "x.lynxr", "rb").read() == residual
    assert verify_file(dest) == []
    assert report["anchor_bytes"] == len(anchor) and report["residual_bytes"] == len(residual)
    assert 0 < report["anchor_ready_s"] <= report["residual_ready_s"]


def test_progressive_load_and_run_source_over_http(cache):
    _, anchor, residual, ref_anchor, ref_full = cache
    path = cache[0]
    with CacheServer(load_served_cache(path)) as srv:
        with open_progressive(srv.url, block_size=8192) as load:
            assert kv_equal(load.wait_anchor(30), ref_anchor)
            assert kv_equal(load.residual.result(30), ref_full)
            assert load.prompt_token_ids == [1, 2, 3]
            assert load.residual_url == f"{srv.base_url}/x.lynxr"
        assert srv.stats.covered("anchor", len(anchor)) and srv.stats.covered("residual", len(residual))


def test_serve_command_in_its_own_process(cache):
    path, anchor, residual, _, _ = cache
    proc = subprocess.Popen([sys.executable, "-m", "lynxkv", "serve", path, "--port", "0", "--once", "--json",
                             "--dscp-anchor", "EF", "--dscp-residual", "CS1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "}\n":
            lines.append(proc.stdout.readline())
            assert lines[-1], proc.stderr.read()
        info = json.loads("".join(lines))
        assert info["url"].startswith("http://127.0.0.1:") and info["url"].endswith("/x.lynx")
        assert info["residual"] == {"path": "x.lynxr", "size": len(residual), "crc32": info["residual"]["crc32"],
                                    "etag": info["residual"]["etag"]}
        with open_progressive(info["url"], decode=False) as load:
            load.residual.result(30)
        assert proc.wait(timeout=30) == 0  # --once: every byte went out once
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_dscp_mark_per_resource_on_one_keep_alive_connection(cache):
    path, anchor, residual, _, _ = cache
    import http.client

    with CacheServer(load_served_cache(path), dscp_anchor=parse_dscp("EF"), dscp_residual=parse_dscp("cs1")) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        for resource in ("/x.lynx", "/x.lynxr", "/x.lynx"):
            conn.request("GET", resource)
            conn.getresponse().read()
        conn.close()
        tos = [(r["resource"], r["tos"]) for r in srv.stats.requests]
    assert tos == [("anchor", 46 << 2), ("residual", 8 << 2), ("anchor", 46 << 2)]


def test_range_requests_and_clean_errors(cache):
    path, anchor, residual, _, _ = cache
    with CacheServer(load_served_cache(path)) as srv:
        status, headers, body = get(srv.url, {"Range": "bytes=100-199"})
        assert (status, body, headers["Content-Range"]) == (206, anchor[100:200], f"bytes 100-199/{len(anchor)}")
        assert get(srv.url, {"Range": "bytes=-10"})[2] == anchor[-10:]
        assert get(f"{srv.base_url}/x.lynxr", {"Range": f"bytes={len(residual) - 5}-"})[2] == residual[-5:]
        status, headers, _ = get(srv.url, method="HEAD")
        assert status == 200 and int(headers["Content-Length"]) == len(anchor)
        for hdrs, method, url, code in [
            ({"Range": "bytes=9-1"}, "GET", srv.url, 400),
            ({"Range": f"bytes={len(anchor)}-"}, "GET", srv.url, 416),
            ({}, "POST", srv.url, 405),
            ({}, "GET", f"{srv.base_url}/../../etc/passwd", 404),
            ({}, "GET", f"{srv.base_url}/x.lynxr.tmp", 404),
        ]:
            status, _, body = get(url, hdrs, method)
            assert status == code and body.startswith(b"lynxkv: "), (hdrs, method, url, status, body)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:  # not HTTP at all
            s.sendall(b"\x16\x03\x01 garbage garbage\r\n\r\n")
            assert b" 400 " in s.recv(100)[:20]
        assert fetch_all(srv) == (anchor, residual)  # still serving


def test_serve_refuses_what_is_not_the_caches_own(tmp_path, cache, capsys):
    _, anchor, residual, _, _ = cache
    evil, _ = cache_bytes(random_kv(layers=2, heads=2, tokens=300, dim=16, seed=1), residual_location="/etc/passwd")
    (tmp_path / "evil.lynx").write_bytes(evil)
    assert main(["serve", str(tmp_path / "evil.lynx"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "--residual" in err and "root:" not in err and "Traceback" not in err
    # a residual that exists but belongs to another cache (another cache_id): refused, not served
    other, other_res = cache_bytes(random_kv(layers=2, heads=2, tokens=700, dim=16, seed=7))
    (tmp_path / "x.lynx").write_bytes(anchor)
    (tmp_path / "x.lynxr").write_bytes(other_res)
    assert main(["serve", str(tmp_path / "x.lynx"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "does not verify" in err and "Traceback" not in err


def test_an_absolute_residual_named_by_the_user_is_served_next_to_the_anchor(tmp_path, cache):
    path, anchor, residual, _, ref_full = cache
    elsewhere = tmp_path / "cold" / "r.bin"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(residual)
    from lynxkv.stream.tier import relocate_residual

    (tmp_path / "a.lynx").write_bytes(relocate_residual(anchor, str(elsewhere)))
    with CacheServer(load_served_cache(str(tmp_path / "a.lynx"), str(elsewhere))) as srv:
        assert srv.cache.relocated and srv.cache.residual.path == "a.lynxr"
        with open_progressive(srv.url) as load:
            assert kv_equal(load.residual.result(30), ref_full)


# ------------------------------------------------------------------------------------------- priority, rate


def _ready_ratio(tl) -> float:
    """Anchor ready / residual ready, both counted from the first anchor byte (the set-up before it, a HEAD and
    two header reads, is a fixed cost that does not depend on how the bytes are split)."""
    t0 = tl.extra["anchor_first_s"]
    return (tl.anchor_ready_s - t0) / (tl.residual_ready_s - t0)


def _best_of(attempts: int, load_once) -> "LoadTimeline":
    """The attempt with the lowest ratio: the ideal for a 4+4 cache is ~0.56, so a busy machine's scheduling
    jitter alone can push one run past 0.6; a design that does not put the anchor first never gets there."""
    best = None
    for _ in range(attempts):
        tl = load_once()
        if best is None or _ready_ratio(tl) < _ready_ratio(best):
            best = tl
        if _ready_ratio(best) <= 0.6:
            break
    return best


@pytest.mark.timing
def test_anchor_first_under_the_servers_own_rate_limit(big):
    path, anchor, residual = big
    with CacheServer(load_served_cache(path), bandwidth=25e6) as srv:  # 200 Mbit/s

        def once():
            with open_progressive(srv.url, decode=False) as load:
                load.residual.result(60)
                return load.timeline

        tl = _best_of(3, once)
    assert _ready_ratio(tl) <= 0.6, tl
    total = (len(anchor) + len(residual)) / 25e6
    assert tl.residual_ready_s >= 0.9 * total  # the rate held


@pytest.mark.timing
def test_anchor_first_on_an_emulated_200_mbit_link(big):
    path, _, _ = big
    with CacheServer(load_served_cache(path)) as srv:

        def once():
            with open_progressive(srv.url, decode=False, link=link_at("200Mbps")) as load:
                load.residual.result(60)
                return load.timeline

        tl = _best_of(3, once)
    assert _ready_ratio(tl) <= 0.6, tl


# ------------------------------------------------------------------------------------------- attacks


def _victim_seconds(srv: CacheServer) -> float:
    t0 = time.perf_counter()
    a, r = fetch_all(srv)
    assert (len(a), len(r)) == (len(srv.cache.anchor.data), len(srv.cache.residual.data))
    return time.perf_counter() - t0


@pytest.mark.timing
def test_an_idle_anchor_reader_does_not_starve_others(big):
    """A client that asks for the anchor and never reads holds no share of the paced link: another client's
    whole transfer takes about as long as alone (generous bound: < 1.5x; starved it would take until the idle
    client's timeout, 20 s). See benchmarks/http_fairness.py for the measured ratio."""
    path, _, _ = big
    with CacheServer(load_served_cache(path), bandwidth=100e6, idle_timeout=20) as srv:
        alone = min(_victim_seconds(srv) for _ in range(2))
        idle = socket.socket()
        idle.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        idle.connect(("127.0.0.1", srv.port))
        idle.sendall(b"GET /x.lynx HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        shared = min(_victim_seconds(srv) for _ in range(2))
        assert any(r["resource"] == "anchor" and r["seconds"] is None for r in srv.stats.requests)  # still stuck
        idle.close()
    assert shared < 1.5 * alone + 0.05, (alone, shared)


def test_idle_connections_are_bounded_cheap_and_dropped(big):
    path, _, _ = big
    threads_before = threading.active_count()
    with CacheServer(load_served_cache(path), max_connections=100, idle_timeout=1.0) as srv:
        # first, so that it is admitted (a connection past the cap is reset, at a moment the client cannot know)
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"GET /x.lynx HTTP/1.1\r\nHo")  # never finishes its headers
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(300)]
        time.sleep(EVICT_AFTER + 0.2)  # idle long enough to make room for a new client
        # bounded: at most 100, and a few more admitted only to be answered 503 (lynxkv/serve/connections.py)
        assert srv.connections <= 100 + srv.limits.extra_refusing
        assert threading.active_count() <= threads_before + 2  # one event-loop thread, not one per connection
        _victim_seconds(srv)  # a real client still gets in and is served
        t0 = time.monotonic()
        while srv.connections and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        assert srv.connections == 0  # idle ones (and the half request) dropped after idle_timeout
        assert srv.stats.evicted >= 100 and srv.stats.evicted + srv.stats.refused >= 301  # closed, or refused
        for s in idle + [slow]:
            s.close()


def test_fifty_concurrent_clients_get_correct_bytes(cache):
    path, anchor, residual, _, _ = cache
    results: list = []
    with CacheServer(load_served_cache(path), bandwidth=100e6) as srv:
        def client(i: int) -> None:
            rng = {"Range": f"bytes={i}-"} if i % 2 else {}
            a = get(srv.url, rng)[2]
            r = get(f"{srv.base_url}/x.lynxr")[2]
            results.append(a == anchor[i if i % 2 else 0:] and r == residual)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        t0 = time.monotonic()
        while srv.connections and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert srv.connections == 0  # every client's connection state is gone
        assert srv.stats.peak_connections > 1  # they really were concurrent
    assert results == [True] * 50


def test_mid_transfer_drops_free_their_state(big):
    path, anchor, _ = big
    with CacheServer(load_served_cache(path), bandwidth=50e6) as srv:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /x.lynx HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(50000)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST mid-body
        t0 = time.monotonic()
        while (srv.connections or srv._egress.waiting()) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert srv.connections == 0 and srv._egress.waiting() == 0
        assert get(srv.url)[2] == anchor  # and it still serves


def test_close_leaves_no_threads(cache):
    path = cache[0]
    before = {t.ident for t in threading.enumerate()}
    srv = CacheServer(load_served_cache(path), bandwidth=1e6).start()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"GET /x.lynx HTTP/1.1\r\nHost: x\r\n\r\n")  # a response in progress at close
    time.sleep(0.1)
    srv.close()
    s.close()
    time.sleep(0.2)
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1)


def test_a_missing_server_is_one_clean_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["stream", f"http://127.0.0.1:{port}/x.lynx"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("lynxkv: error:") and "Traceback" not in err


def test_load_served_cache_rejects_a_corrupt_anchor(tmp_path, cache):
    _, anchor, residual, _, _ = cache
    bad = bytearray(anchor)
    bad[-2] ^= 0xFF
    (tmp_path / "x.lynx").write_bytes(bytes(bad))
    (tmp_path / "x.lynxr").write_bytes(residual)
    with pytest.raises(LynxError, match="does not verify"):
        load_served_cache(str(tmp_path / "x.lynx"))
