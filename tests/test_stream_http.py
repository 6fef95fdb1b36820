"""The http(s):// tier: a read-only cache served by a plain HTTP server with Range support, on loopback."""

from __future__ import annotations

import http.server
import os
import re
import threading

import pytest
from fixtures_s3 import cache_bytes, kv_equal, random_kv, write_pair

from lynxkv.cache import open_cache
from lynxkv.stream import open_progressive

pytestmark = pytest.mark.network


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with ``Range: bytes=a-b`` answered by 206 (what object stores and CDNs do)."""

    requests: list = []

    def log_message(self, *args):  # quiet
        pass

    def send_head(self):
        path = self.translate_path(self.path)
        rng = self.headers.get("Range")
        if not rng or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        m = re.match(r"bytes=(\d+)-(\d*)", rng)
        start, end = int(m.group(1)), int(m.group(2) or size - 1)
        end = min(end, size - 1)
        RangeHandler.requests.append((start, end))
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        return _Limited(f, end - start + 1)


class _Limited:
    def __init__(self, f, n):
        self.f, self.n = f, n

    def read(self, size=-1):
        size = self.n if size < 0 else min(size, self.n)
        data = self.f.read(size)
        self.n -= len(data)
        return data

    def close(self):
        self.f.close()


@pytest.fixture(scope="module")
def http_dir(tmp_path_factory):
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")
    d = tmp_path_factory.mktemp("http")
    handler = lambda *a, **kw: RangeHandler(*a, directory=str(d), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield d, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_progressive_load_over_http_ranges(http_dir):
    d, base = http_dir
    anchor, residual = cache_bytes(random_kv(layers=2, heads=2, tokens=400, dim=16, seed=9))
    write_pair(d, anchor, residual)
    with open_cache(anchor, residual=residual) as c:
        ref_anchor, ref_full = c.load_kv(anchor_only=True), c.load_kv()
    RangeHandler.requests.clear()
    with open_progressive(f"{base}/x.lynx", block_size=8192) as load:
        assert kv_equal(load.wait_anchor(60), ref_anchor)
        assert kv_equal(load.residual.result(60), ref_full)
        assert load.residual_url == f"{base}/x.lynxr"
    assert len(RangeHandler.requests) > 4  # byte-range reads, not whole-file downloads
