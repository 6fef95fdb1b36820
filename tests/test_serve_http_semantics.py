"""``lynxkv serve`` against RFC 9110 range semantics, through a real server on loopback and a raw HTTP client
(http.client): single and multiple ranges, ``If-Range`` with entity tags and dates, ``HEAD``, 416, and a cache
replaced on disk while a client resumes from the old version."""

from __future__ import annotations

import email.utils
import http.client
import os
import time

import pytest
from fixtures_s3 import synthetic_cache_bytes, write_pair

from lynxkv.serve import CacheServer, load_served_cache

pytestmark = pytest.mark.network

SHAPE = dict(layers=1, heads=2, tokens=256, dim=32)
HOUR = 3600


def request(srv: CacheServer, method: str, path: str, headers: dict | None = None):
    """(status, headers with lower-case names, body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def replace(path: str, data: bytes) -> None:
    """Write ``data`` under a temporary name and rename it over ``path``, as a careful writer does."""
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def age(*paths: str, seconds: float = HOUR) -> None:
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server over a cache written an hour ago, and what a client learns from a first GET of each resource."""
    d = tmp_path_factory.mktemp("semantics")
    anchor, residual = synthetic_cache_bytes(**SHAPE, seed=1)
    path = write_pair(d, anchor, residual)
    age(path, path + "r")
    with CacheServer(load_served_cache(path)) as srv:
        first = {name: request(srv, "GET", "/x." + suffix)[1] for name, suffix in (("anchor", "lynx"),
                                                                                  ("residual", "lynxr"))}
        yield srv, {"anchor": anchor, "residual": residual}, first, os.stat(path).st_mtime_ns // 10**9


MANY = "bytes=" + ",".join(f"{i}-{i}" for i in range(500))
WHOLE = (0, None)
# id, method, resource, headers ({etag}, {date}, {n}, {n5}, {older} filled in), status, bytes [a, b) of the resource
CASES = [
    ("get", "GET", "anchor", {}, 200, WHOLE),
    ("head", "HEAD", "anchor", {}, 200, WHOLE),
    ("first-ten", "GET", "anchor", {"Range": "bytes=0-9"}, 206, (0, 10)),
    ("open-ended", "GET", "anchor", {"Range": "bytes=100-"}, 206, (100, None)),
    ("suffix", "GET", "anchor", {"Range": "bytes=-10"}, 206, (-10, None)),
    ("end-past-size", "GET", "anchor", {"Range": "bytes=5-99999999999"}, 206, (5, None)),
    ("suffix-past-size", "GET", "anchor", {"Range": "bytes=-{n5}"}, 206, WHOLE),
    ("unit-case-and-spaces", "GET", "anchor", {"Range": "Bytes= 3-4 "}, 206, (3, 5)),
    ("one-range-in-a-list", "GET", "anchor", {"Range": "bytes=0-9, ,"}, 206, (0, 10)),
    ("residual-range", "GET", "residual", {"Range": "bytes=7-19"}, 206, (7, 20)),
    ("head-range", "HEAD", "anchor", {"Range": "bytes=0-9"}, 206, (0, 10)),
    ("two-ranges-ignored", "GET", "anchor", {"Range": "bytes=0-9,20-29"}, 200, WHOLE),
    ("overlapping-ranges-ignored", "GET", "anchor", {"Range": "bytes=0-9,5-"}, 200, WHOLE),
    ("500-ranges-ignored", "GET", "anchor", {"Range": MANY}, 200, WHOLE),
    ("unknown-unit-ignored", "GET", "anchor", {"Range": "items=0-9"}, 200, WHOLE),
    ("malformed-reversed", "GET", "anchor", {"Range": "bytes=9-1"}, 400, None),
    ("malformed-letters", "GET", "anchor", {"Range": "bytes=a-b"}, 400, None),
    ("malformed-no-unit", "GET", "anchor", {"Range": "0-9"}, 400, None),
    ("unsatisfiable-start", "GET", "anchor", {"Range": "bytes={n}-"}, 416, None),
    ("unsatisfiable-empty-suffix", "GET", "anchor", {"Range": "bytes=-0"}, 416, None),
    ("if-range-etag", "GET", "anchor", {"Range": "bytes=10-19", "If-Range": "{etag}"}, 206, (10, 20)),
    ("if-range-date", "GET", "anchor", {"Range": "bytes=10-19", "If-Range": "{date}"}, 206, (10, 20)),
    ("if-range-stale-etag", "GET", "anchor", {"Range": "bytes=10-19", "If-Range": '"0123abcd"'}, 200, WHOLE),
    ("if-range-weak-etag", "GET", "anchor", {"Range": "bytes=10-19", "If-Range": "W/{etag}"}, 200, WHOLE),
    ("if-range-older-date", "GET", "anchor", {"Range": "bytes=10-19", "If-Range": "{older}"}, 200, WHOLE),
    ("if-range-garbage", "GET", "anchor", {"Range": "bytes=10-19", "If-Range": "yesterday"}, 200, WHOLE),
    ("if-range-stale-bad-range", "GET", "anchor", {"Range": "bytes={n}-", "If-Range": '"0123abcd"'}, 200, WHOLE),
    ("if-range-fresh-bad-range", "GET", "anchor", {"Range": "bytes={n}-", "If-Range": "{etag}"}, 416, None),
    ("if-range-without-range", "GET", "anchor", {"If-Range": '"0123abcd"'}, 200, WHOLE),
    ("head-if-range-stale", "HEAD", "anchor", {"Range": "bytes=0-9", "If-Range": '"0123abcd"'}, 200, WHOLE),
]


@pytest.mark.parametrize("method,resource,headers,status,span", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_range_semantics(served, method, resource, headers, status, span):
    srv, data, first, mtime = served
    whole = data[resource]
    n = len(whole)
    fill = {"etag": first[resource]["etag"], "date": first[resource]["last-modified"], "n": n, "n5": n + 5,
            "older": email.utils.formatdate(mtime - HOUR, usegmt=True)}
    got_status, got, body = request(srv, method, "/x.lynx" + ("r" if resource == "residual" else ""),
                                    {k: v.format(**fill) for k, v in headers.items()})
    assert got_status == status, (got_status, body[:200])
    if span is None:  # an error: one line, and for a 416 the size
        assert body.startswith(b"lynxkv: ") and body.endswith(b"\n") and body.count(b"\n") == 1
        if status == 416:
            assert got["content-range"] == f"bytes */{n}"
        return
    a, b = span
    want = whole[a:b]
    assert body == (b"" if method == "HEAD" else want)
    assert int(got["content-length"]) == len(want)
    assert (got["accept-ranges"], got["etag"], got["last-modified"]) == (
        "bytes", first[resource]["etag"], email.utils.formatdate(mtime, usegmt=True))
    assert not got["etag"].startswith("W/") and got["etag"].startswith('"')
    start = a % n
    assert got.get("content-range") == (f"bytes {start}-{start + len(want) - 1}/{n}" if status == 206 else None)


def test_head_has_the_same_headers_as_get(served):
    srv = served[0]
    for headers in ({}, {"Range": "bytes=3-30"}):
        _, on_get, body = request(srv, "GET", "/x.lynx", headers)
        _, on_head, empty = request(srv, "HEAD", "/x.lynx", headers)
        assert empty == b"" and len(body) == int(on_head["content-length"])
        assert {k: v for k, v in on_head.items() if k != "date"} == {k: v for k, v in on_get.items() if k != "date"}


def test_a_stale_if_range_after_the_file_is_replaced_gets_the_new_whole_body(tmp_path):
    old_anchor, old_residual = synthetic_cache_bytes(**SHAPE, seed=2)
    new_anchor, new_residual = synthetic_cache_bytes(**SHAPE, seed=3)
    path = write_pair(tmp_path, old_anchor, old_residual)
    with CacheServer(load_served_cache(path)) as srv:
        _, old, _ = request(srv, "GET", "/x.lynx", {"Range": "bytes=0-99"})
        _, old_r, _ = request(srv, "GET", "/x.lynxr", {"Range": "bytes=0-99"})
        replace(path + "r", new_residual)
        replace(path, new_anchor)
        status, got, body = request(srv, "GET", "/x.lynx", {"Range": "bytes=100-", "If-Range": old["etag"]})
        assert (status, body) == (200, new_anchor) and got["etag"] != old["etag"]
        status, _, body = request(srv, "GET", "/x.lynxr", {"Range": "bytes=100-", "If-Range": old_r["etag"]})
        assert (status, body) == (200, new_residual)
        status, _, body = request(srv, "GET", "/x.lynx", {"Range": "bytes=100-", "If-Range": got["etag"]})
        assert (status, body) == (206, new_anchor[100:])
        assert srv.describe()["anchor"]["etag"] == got["etag"]


def test_a_response_in_flight_keeps_the_version_it_began_with(tmp_path):
    """A slow client's response goes on from the old version's bytes while the next request gets the new one."""
    old_anchor, old_residual = synthetic_cache_bytes(layers=2, heads=4, tokens=2048, dim=64, seed=4)  # ~2.6 MB
    new_anchor, new_residual = synthetic_cache_bytes(layers=2, heads=4, tokens=2048, dim=64, seed=5)
    assert len(old_anchor) == len(new_anchor) and old_anchor != new_anchor
    path = write_pair(tmp_path, old_anchor, old_residual)
    with CacheServer(load_served_cache(path), write_buffer=64 << 10) as srv:
        slow = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        slow.request("GET", "/x.lynx")
        r = slow.getresponse()
        head = r.read(1000)  # the rest waits in the server, far from done
        replace(path + "r", new_residual)
        replace(path, new_anchor)
        assert request(srv, "GET", "/x.lynx")[2] == new_anchor
        assert head + r.read() == old_anchor
        slow.close()


def test_a_replacement_that_does_not_verify_leaves_the_old_version_served(tmp_path):
    """An anchor renamed over before its residual: the pair on disk is not one cache, so the version read before
    is served whole (and resumable) until the residual follows."""
    old_anchor, old_residual = synthetic_cache_bytes(**SHAPE, seed=6)
    new_anchor, new_residual = synthetic_cache_bytes(**SHAPE, seed=7)
    path = write_pair(tmp_path, old_anchor, old_residual)
    logged: list[str] = []
    with CacheServer(load_served_cache(path), log=logged.append) as srv:
        _, old, _ = request(srv, "GET", "/x.lynx")
        replace(path, new_anchor)
        status, got, body = request(srv, "GET", "/x.lynx", {"Range": "bytes=0-9", "If-Range": old["etag"]})
        assert (status, body, got["etag"]) == (206, old_anchor[:10], old["etag"])
        assert request(srv, "GET", "/x.lynxr")[2] == old_residual
        assert any("not served" in line for line in logged)
        replace(path + "r", new_residual)
        deadline = time.monotonic() + 10
        while request(srv, "GET", "/x.lynx")[2] != new_anchor and time.monotonic() < deadline:
            time.sleep(0.1)  # the next try comes a second after the failed one
        status, _, body = request(srv, "GET", "/x.lynx", {"Range": "bytes=0-9", "If-Range": old["etag"]})
        assert (status, body) == (200, new_anchor)
        assert request(srv, "GET", "/x.lynxr")[2] == new_residual


def test_a_date_validates_only_once_its_second_is_over(tmp_path):
    """A file whose mtime is still to come (or was just written) could share its date with the next version: no
    Last-Modified is sent for it and an If-Range date never selects a range of it; the ETag still does."""
    anchor, residual = synthetic_cache_bytes(**SHAPE, seed=8)
    path = write_pair(tmp_path, anchor, residual)
    age(path, seconds=-HOUR)  # an hour ahead
    with CacheServer(load_served_cache(path)) as srv:
        _, got, _ = request(srv, "GET", "/x.lynx")
        assert "last-modified" not in got
        date = email.utils.formatdate(os.stat(path).st_mtime_ns // 10**9, usegmt=True)
        assert request(srv, "GET", "/x.lynx", {"Range": "bytes=0-9", "If-Range": date})[0] == 200
        assert request(srv, "GET", "/x.lynx", {"Range": "bytes=0-9", "If-Range": got["etag"]})[0] == 206


def test_a_copy_that_kept_the_old_date_is_told_apart(tmp_path):
    """A new version renamed over with the old one's mtime (cp -p, tar): the old date no longer selects a range."""
    old_anchor, old_residual = synthetic_cache_bytes(**SHAPE, seed=9)
    new_anchor, new_residual = synthetic_cache_bytes(**SHAPE, seed=10)
    path = write_pair(tmp_path, old_anchor, old_residual)
    age(path, path + "r")
    with CacheServer(load_served_cache(path)) as srv:
        _, old, _ = request(srv, "GET", "/x.lynx")
        kept = {p: os.stat(p).st_mtime_ns for p in (path, path + "r")}
        replace(path + "r", new_residual)
        replace(path, new_anchor)
        for p, mtime in kept.items():
            os.utime(p, ns=(mtime, mtime))
        status, got, body = request(srv, "GET", "/x.lynx", {"Range": "bytes=0-9", "If-Range": old["last-modified"]})
        assert (status, body) == (200, new_anchor) and got["etag"] != old["etag"]
        assert "last-modified" not in got
        assert request(srv, "GET", "/x.lynx", {"Range": "bytes=0-9", "If-Range": got["etag"]})[2] == new_anchor[:10]


def test_an_anchor_the_server_rewrote_has_no_date(tmp_path):
    """An anchor whose header the server rewrote (its residual recorded elsewhere) is the server's bytes, not its
    file's: no Last-Modified, so a date from a server that rewrote it otherwise never selects a range of it."""
    from lynxkv.stream.tier import relocate_residual

    anchor, residual = synthetic_cache_bytes(**SHAPE, seed=11)
    elsewhere = tmp_path / "cold" / "r.bin"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(residual)
    (tmp_path / "a.lynx").write_bytes(relocate_residual(anchor, str(elsewhere)))
    age(str(tmp_path / "a.lynx"), str(elsewhere))
    with CacheServer(load_served_cache(str(tmp_path / "a.lynx"), str(elsewhere))) as srv:
        assert srv.cache.relocated
        _, got, _ = request(srv, "HEAD", "/a.lynx")
        assert "last-modified" not in got and got["etag"].startswith('"')
        _, side, _ = request(srv, "HEAD", "/a.lynxr")
        assert side["last-modified"] == email.utils.formatdate(elsewhere.stat().st_mtime_ns // 10**9, usegmt=True)
        date = email.utils.formatdate((tmp_path / "a.lynx").stat().st_mtime_ns // 10**9, usegmt=True)
        assert request(srv, "GET", "/a.lynx", {"Range": "bytes=0-9", "If-Range": date})[0] == 200
