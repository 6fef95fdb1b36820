"""``serve`` -> ``stream`` over loopback TCP: byte-identical copies, priority, DSCP marks, framing, resets."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from fixtures_s3 import cache_bytes, kv_equal, random_kv, synthetic_cache_bytes, write_pair

from lynxkv.cache import open_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import LynxError
from lynxkv.stream import open_progressive
from lynxkv.stream.tcp import (
    BLOCK,
    DATA,
    HEADER,
    HELLO,
    MAGIC,
    MAX_PAYLOAD,
    CacheServer,
    ProtocolError,
    SegmentFile,
    TcpSource,
    decode_header,
    encode_frame,
    parse_dscp,
    receive_segments,
)

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("tcp")
    kv = random_kv(layers=2, heads=2, tokens=700, dim=16, seed=5)
    anchor, residual = cache_bytes(kv, residual_location="x.lynxr")
    path = write_pair(d, anchor, residual)
    with open_cache(path) as c:
        return path, anchor, residual, c.load_kv(anchor_only=True), c.load_kv()


def _server(anchor, residual, **kw):
    return CacheServer(SegmentFile("x.lynx", anchor), SegmentFile("x.lynxr", residual) if residual else None,
                       **kw).start()


def test_serve_to_stream_writes_a_byte_identical_verified_cache(tmp_path, cache, capsys):
    path, anchor, residual, _, _ = cache
    with _server(anchor, residual, bandwidth=20e6) as srv:
        dest = str(tmp_path / "got" / "copy.lynx")
        assert main(["stream", f"tcp://127.0.0.1:{srv.port}", "-o", dest, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert open(dest, "rb").read() == anchor
    assert open(tmp_path / "got" / "x.lynxr", "rb").read() == residual
    assert verify_file(dest) == []
    assert report["anchor_bytes"] == len(anchor) and report["residual_bytes"] == len(residual)
    assert 0 < report["anchor_ready_s"] <= report["residual_ready_s"]
    assert set(report["monolithic"]) == {"bf16", "int8", "int4"}


def test_serve_command_in_its_own_process(tmp_path, cache):
    path, anchor, residual, _, _ = cache
    proc = subprocess.Popen([sys.executable, "-m", "lynxkv", "serve", path, "--port", "0", "--once",
                             "--dscp-anchor", "EF", "--dscp-residual", "CS1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        port = int(re.search(r"tcp://127\.0\.0\.1:(\d+)", line).group(1))
        manifest, got_a, got_r = receive_segments(f"tcp://127.0.0.1:{port}")
        assert got_a == anchor and got_r == residual
        assert manifest["residual"]["name"] == "x.lynxr"
        assert proc.wait(timeout=30) == 0  # --once: exits after one complete transfer
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_dscp_marks_and_strict_priority_on_the_wire(cache):
    _, anchor, residual, _, _ = cache
    with _server(anchor, residual, bandwidth=10e6, dscp_anchor=parse_dscp("EF"),
                 dscp_residual=parse_dscp("cs1")) as srv:
        _, got_a, got_r = receive_segments(f"tcp://127.0.0.1:{srv.port}")
        time.sleep(0.05)
        rep = srv.link.report()
        tos = {c["stream"]: c["tos"] for c in srv.stats.connections}
    assert got_a == anchor and got_r == residual
    assert tos == {"anchor": 46 << 2, "residual": 8 << 2}
    assert rep["residual"]["first_s"] >= rep["anchor"]["last_s"] - 0.005  # the residual waited for the anchor


def test_progressive_load_over_tcp(cache):
    _, anchor, residual, ref_anchor, ref_full = cache
    with _server(anchor, residual) as srv:
        with open_progressive(f"tcp://127.0.0.1:{srv.port}") as load:
            assert kv_equal(load.wait_anchor(30), ref_anchor)
            assert kv_equal(load.residual.result(30), ref_full)
            assert load.prompt_token_ids == [1, 2, 3]


class CuttingProxy:
    """A TCP proxy to ``target`` that resets the first residual connection after ``cut`` bytes."""

    def __init__(self, target_port: int, cut: int, stall: float = 0.0):
        self.stall = stall  # > 0: go silent for this long instead of resetting
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.target, self.cut = target_port, cut
        self.resets = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(c,), daemon=True).start()

    def _pipe(self, client):
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            client.close()
            return
        hello = client.recv(65536)
        upstream.sendall(hello)
        cut = b'"residual"' in hello and self.resets == 0
        if cut:
            self.resets += 1
        sent = 0
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if cut and sent + len(data) > self.cut:
                    client.sendall(data[: self.cut - sent])
                    if self.stall:
                        time.sleep(self.stall)  # a stalled connection: open, silent
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break  # close with RST
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    def close(self):
        self.sock.close()


def test_stalled_residual_connection_is_abandoned_and_resumed(cache):
    from lynxkv.storage import RetryPolicy

    _, anchor, residual, _, ref_full = cache
    with _server(anchor, residual, block=4096) as srv:
        proxy = CuttingProxy(srv.port, cut=len(residual) // 2, stall=3.0)
        try:
            with open_progressive(f"tcp://127.0.0.1:{proxy.port}",
                                  retry=RetryPolicy(attempts=3, base=0.01, stall_timeout=0.4)) as load:
                t0 = time.perf_counter()
                assert kv_equal(load.residual.result(30), ref_full)
                assert time.perf_counter() - t0 < 2.5  # did not wait for the stall to end
                assert any("reconnecting at byte" in r for r in load.timeline.extra["retries"])
        finally:
            proxy.close()


def test_connection_reset_mid_residual_resumes(cache):
    _, anchor, residual, _, ref_full = cache
    with _server(anchor, residual, block=4096) as srv:
        proxy = CuttingProxy(srv.port, cut=len(residual) // 2)
        try:
            with open_progressive(f"tcp://127.0.0.1:{proxy.port}") as load:
                assert kv_equal(load.residual.result(30), ref_full)
                retries = load.timeline.extra["retries"]
        finally:
            proxy.close()
    assert proxy.resets == 1 and any("reconnecting at byte" in r for r in retries)
    resumed = [c for c in srv.stats.connections if c["stream"] == "residual" and c["offset"] > 0]
    assert resumed and resumed[0]["offset"] < len(residual)  # resumed mid-segment, not restarted


# ------------------------------------------------------------------------------------------------ framing


@pytest.mark.parametrize("raw,match", [
    (b"XX" + bytes([1, DATA]) + struct.pack("<I", 4), "magic"),
    (MAGIC + bytes([2, DATA]) + struct.pack("<I", 4), "version"),
    (MAGIC + bytes([1, 9]) + struct.pack("<I", 4), "type"),
    (MAGIC + bytes([1, DATA]) + struct.pack("<I", MAX_PAYLOAD + 1), "length"),
], ids=["magic", "version", "type", "length"])
def test_malformed_frame_headers(raw, match):
    assert len(raw) == HEADER.size
    with pytest.raises(ProtocolError, match=match):
        decode_header(raw)


def test_frame_round_trip():
    kind, length = decode_header(encode_frame(DATA, b"abc")[: HEADER.size])
    assert (kind, length) == (DATA, 3)


def _fake_server(reply: bytes):
    sock = socket.create_server(("127.0.0.1", 0))

    def run():
        c, _ = sock.accept()
        c.recv(4096)
        c.sendall(reply)
        time.sleep(0.05)
        c.close()
        sock.close()

    threading.Thread(target=run, daemon=True).start()
    return sock.getsockname()[1]


@pytest.mark.parametrize("reply,match", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "magic"),
    (encode_frame(2, b"not json"), "MANIFEST frame: invalid JSON"),
    (encode_frame(5, b"go away"), "refused.*go away"),
    (encode_frame(2, json.dumps({"anchor": {"name": "x", "size": 10, "crc32": 0}, "residual": None}).encode())
     + encode_frame(DATA, b"0123456789ABCDEF"), "more than 10 bytes"),
], ids=["not-lynx", "bad-json", "error-frame", "overlong"])
def test_malformed_server_replies_are_lynx_errors(reply, match):
    port = _fake_server(reply)
    with pytest.raises(LynxError, match=match):
        list(TcpSource(f"tcp://127.0.0.1:{port}", "anchor", attempts=1))


def test_server_refuses_a_bad_hello(cache):
    _, anchor, residual, _, _ = cache
    with _server(anchor, residual) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(encode_frame(HELLO, json.dumps({"stream": "everything"}).encode()))
            kind, length = decode_header(s.recv(HEADER.size))
            assert kind == 5 and b"unknown" in s.recv(length)


def test_truncated_stream_is_not_written(tmp_path, cache):
    """A server that dies for good mid-residual: the copy under -o is never created."""
    _, anchor, residual, _, _ = cache
    dest = tmp_path / "out" / "x.lynx"
    with _server(anchor, residual) as srv:
        proxy = CuttingProxy(srv.port, cut=BLOCK // 3)
        proxy.resets = 0
        srv.close()  # no reconnect can succeed
        assert main(["stream", f"tcp://127.0.0.1:{proxy.port}", "-o", str(dest)]) == 1
        proxy.close()
    assert not dest.exists() and not (tmp_path / "out" / "x.lynxr").exists()


def test_one_gbps_over_tcp_rate_limited_server(tmp_path):
    """The server's own rate limit: 1 Gbit/s shared by both connections, the anchor first."""
    anchor, residual = synthetic_cache_bytes(layers=4, heads=8, tokens=2048, dim=128)  # about 19 MB
    with _server(anchor, residual, bandwidth=125e6) as srv:
        with open_progressive(f"tcp://127.0.0.1:{srv.port}", decode=False) as load:
            load.residual.result(60)
            tl = load.timeline
        rep = srv.link.report()
    assert tl.anchor_ready_s <= 0.6 * tl.residual_ready_s
    assert rep["total"]["rate"] == pytest.approx(125e6, rel=0.10)


def test_random_bytes_from_a_server_only_raise_lynx_errors():
    """Fuzz the client's frame parser: whatever a server sends, the client raises a LynxError (never another
    exception, never a hang, never an allocation of what a length field merely claims)."""
    import random

    rng = random.Random(11)
    good = encode_frame(2, json.dumps({"anchor": {"name": "x", "size": 64, "crc32": 0}, "residual": None}).encode())
    good += encode_frame(DATA, bytes(64))
    for _ in range(25):
        reply = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            reply[rng.randrange(len(reply))] = rng.randrange(256)
        reply = bytes(reply[: rng.randint(0, len(reply))])
        port = _fake_server(reply)
        with pytest.raises(LynxError):
            list(TcpSource(f"tcp://127.0.0.1:{port}", "anchor", attempts=1, timeout=2))


def test_close_leaves_no_worker_threads(cache):
    _, anchor, residual, _, _ = cache
    before = {t.ident for t in threading.enumerate()}
    with _server(anchor, residual, bandwidth=1e6) as srv:  # slow: close() arrives mid-transfer
        load = open_progressive(f"tcp://127.0.0.1:{srv.port}")
        time.sleep(0.05)
        load.close()
        with pytest.raises(LynxError):
            load.residual.result(5)
    time.sleep(0.3)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("lynxkv")]
    assert left == []


def test_progressive_single_file_over_tcp(cache):
    """A single-file cache arrives whole on the anchor connection; both parsers share that one stream."""
    *_, ref_anchor, ref_full = cache
    anchor, _ = cache_bytes(random_kv(layers=2, heads=2, tokens=700, dim=16, seed=5), single_file=True)
    for _ in range(3):  # the two parsers race on one buffer: run it a few times
        with _server(anchor, None) as srv:
            with open_progressive(f"tcp://127.0.0.1:{srv.port}") as load:
                assert kv_equal(load.wait_anchor(30), ref_anchor)
                assert kv_equal(load.residual.result(30), ref_full)
