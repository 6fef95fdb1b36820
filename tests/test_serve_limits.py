"""The limits of ``lynxkv serve`` (lynxkv/serve/connections.py): the connection cap answers 503, the header and idle
timeouts, the per-connection and overall bounds on bytes queued for slow readers (asserted on the server's own
counters, never on wall-clock time), and correct ranged reads while slow clients hold their connections."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from fixtures_s3 import synthetic_cache_bytes, write_pair

from lynxkv.cli import main
from lynxkv.errors import InputError
from lynxkv.serve import CacheServer, load_served_cache
from lynxkv.serve.connections import Limits
from lynxkv.serve.egress import QUANTUM

pytestmark = pytest.mark.network

HEADERS = 1024  # a response header's bytes, which go out before the first chunk is accounted


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """~19 MB, so that a slow reader's response is far from done when the test looks."""
    d = tmp_path_factory.mktemp("limits")
    anchor, residual = synthetic_cache_bytes(layers=4, heads=8, tokens=2048, dim=128)
    return write_pair(d, anchor, residual), anchor, residual


def wait_for(cond, timeout: float = 10.0) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def slow_reader(port: int, path: str = "/x.lynx") -> socket.socket:
    """Asks for a whole resource through a 4 KiB receive window and never reads."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def ranged(port: int, path: str, a: int, b: int) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nRange: bytes={a}-{b}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def recv_body(s: socket.socket, n: int) -> bytes:
    """The last ``n`` bytes of one response on a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < n:
        chunk = s.recv(1 << 16)
        assert chunk, data
        data += chunk
    return data.partition(b"\r\n\r\n")[2]


def stalled(srv: CacheServer, n: int) -> bool:
    """``n`` responses in progress, none of which has moved for a few watchdog ticks."""
    busy = [r["sent"] for r in srv.stats.requests if r["seconds"] is None and r["sent"]]
    if len(busy) < n:
        return False
    time.sleep(0.3)
    return [r["sent"] for r in srv.stats.requests if r["seconds"] is None and r["sent"]] == busy


def test_the_connection_cap_answers_503_and_an_idle_connection_makes_room(big):
    path, anchor, _ = big
    with CacheServer(load_served_cache(path), max_connections=2, idle_timeout=30) as srv:
        busy = [slow_reader(srv.port) for _ in range(2)]  # both connections have a response in progress
        assert wait_for(lambda: stalled(srv, 2))
        head, body = ranged(srv.port, "/x.lynx", 0, 99)
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head and b"server busy" in body
        assert srv.stats.refused == 1 and srv.connections <= 3
        for s in busy:
            s.close()
        assert wait_for(lambda: srv.connections == 0)
        # an idle keep-alive connection (idle for over a second) makes room for a new one
        idle = socket.create_connection(("127.0.0.1", srv.port))
        idle2 = socket.create_connection(("127.0.0.1", srv.port))
        time.sleep(1.2)
        head, body = ranged(srv.port, "/x.lynx", 10, 109)
        assert head.startswith(b"HTTP/1.1 206") and body == anchor[10:110]
        assert srv.stats.evicted == 1 and srv.stats.refused == 1
        idle.close()
        idle2.close()


def test_header_timeout_closes_idle_and_trickling_clients_but_not_keep_alive_ones(big):
    path, anchor, _ = big
    with CacheServer(load_served_cache(path), header_timeout=0.5, idle_timeout=30) as srv:
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        trickle = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        trickle.sendall(b"GET /x.lynx HTTP/1.1\r\nHost: x\r\nX-a")
        keep = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        keep.sendall(b"GET /x.lynx HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n\r\n")
        assert recv_body(keep, 10) == anchor[:10]
        for _ in range(3):  # one header byte now and then does not extend the deadline
            time.sleep(0.1)
            trickle.sendall(b"a")
        assert wait_for(lambda: srv.stats.header_timeouts == 2)
        for s in (silent, trickle):
            try:
                assert s.recv(10) == b""  # closed by the server
            except ConnectionResetError:
                pass
        assert srv.connections == 1  # the keep-alive connection that completed a request is still open
        keep.sendall(b"GET /x.lynx HTTP/1.1\r\nHost: x\r\nRange: bytes=10-19\r\n\r\n")
        assert recv_body(keep, 10) == anchor[10:20]
        for s in (silent, trickle, keep):
            s.close()


def test_a_client_that_takes_nothing_is_reset_after_idle_timeout(big):
    path, _, _ = big
    with CacheServer(load_served_cache(path), idle_timeout=0.5) as srv:
        s = slow_reader(srv.port)
        assert wait_for(lambda: srv.stats.abandoned == 1)
        assert wait_for(lambda: srv.connections == 0)
        # reset, not closed: the kernel dropped what it still held for the client instead of trickling it out
        assert wait_for(lambda: s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0, 5)
        s.close()


def test_a_slow_reader_holds_at_most_its_write_buffer(big):
    path, _, _ = big
    n, wbuf = 4, 64 << 10
    with CacheServer(load_served_cache(path), write_buffer=wbuf, idle_timeout=30) as srv:
        slow = [slow_reader(srv.port) for _ in range(n)]
        assert wait_for(lambda: stalled(srv, n))
        held = [h.transport.get_write_buffer_size() for h, _ in srv._conns.items() if h.transport is not None]
        assert len(held) == n and min(held) > 0  # each really is stuck with bytes queued
        assert max(held) <= wbuf + 2 * QUANTUM  # where the transport pauses the response
        assert sum(held) <= srv._conns.buffered  # the count is never below what the transports hold
        assert srv.stats.budget_waits == 0  # the per-connection bound alone held them
        for s in slow:
            s.close()
        assert wait_for(lambda: srv.connections == 0 and srv._conns.buffered == 0)


def test_slow_readers_share_the_overall_budget_and_ranged_reads_stay_correct(big):
    path, anchor, residual = big
    n, wbuf, budget = 8, 1 << 20, 256 << 10  # per connection alone, 8 slow readers could queue 8+ MiB
    with CacheServer(load_served_cache(path), write_buffer=wbuf, max_buffered=budget, idle_timeout=30) as srv:
        slow = [slow_reader(srv.port, "/x.lynx" if i % 2 else "/x.lynxr") for i in range(n)]
        assert wait_for(lambda: stalled(srv, n))
        held = [h.transport.get_write_buffer_size() for h, _ in srv._conns.items() if h.transport is not None]
        assert len(held) == n and sum(held) <= srv._conns.buffered
        assert srv.stats.budget_waits > 0  # the slow ones waited for the budget
        assert srv.stats.peak_buffered <= budget + n * (QUANTUM + HEADERS)  # overall
        # while they are stuck, ranged reads are answered, byte for byte
        for a, b in [(0, 99), (12345, 12345 + 3 * QUANTUM), (len(residual) - 500, len(residual) - 1)]:
            head, body = ranged(srv.port, "/x.lynxr", a, b)
            assert head.startswith(b"HTTP/1.1 206") and body == residual[a:b + 1]
        head, body = ranged(srv.port, "/x.lynx", 7, 7 + QUANTUM)
        assert body == anchor[7:8 + QUANTUM]
        for s in slow:
            s.close()
        assert wait_for(lambda: srv.connections == 0 and srv._conns.buffered == 0)


def test_limits_are_checked_and_the_cli_reports_its_counters(big, capsys):
    path, _, _ = big
    with pytest.raises(InputError, match="write_buffer"):
        Limits(write_buffer=10)
    with pytest.raises(InputError, match="at most 1073741824"):  # each connection's SO_SNDBUF would refuse it
        Limits(write_buffer=3 << 30)
    assert main(["serve", path, "--port", "0", "--max-buffered", "lots"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("lynxkv: error: size 'lots'") and "Traceback" not in err
    proc = subprocess.Popen([sys.executable, "-m", "lynxkv", "serve", path, "--port", "0", "--json", "--once"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "}\n":
            lines.append(proc.stdout.readline())
            assert lines[-1], proc.stderr.read()
        port = json.loads("".join(lines))["port"]
        for p in ("/x.lynx", "/x.lynxr"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(f"GET {p} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                while s.recv(1 << 20):
                    pass
        out, err = proc.communicate(timeout=60)
        counters = json.loads(out)
        assert counters["served"] == 2 and counters["refused"] == 0 and counters["peak_connections"] >= 1
        assert "served 2 requests" in err
    finally:
        if proc.poll() is None:
            proc.kill()


def _start_json_server(path: str, **popen) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "lynxkv", "serve", path, "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    lines = []
    while not lines or lines[-1] != "}\n":
        lines.append(proc.stdout.readline())
        assert lines[-1], proc.stderr.read()
    return proc, json.loads("".join(lines))["port"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_closes_the_server_gracefully_with_its_counters(big, sig):
    """What a process manager sends (SIGTERM) or a terminal (Ctrl-C): exit 0 with the counters printed, not a
    kill or a traceback."""
    import signal

    path, anchor, _ = big
    # as from a terminal, however this suite was started (a background job inherits SIGINT ignored)
    proc, port = _start_json_server(path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        head, body = ranged(port, "/x.lynx", 0, 99)
        assert b" 206 " in head and body == anchor[:100]
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert json.loads(out)["served"] == 1 and "served 1 requests" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigint_ignored_at_start_stays_ignored_and_sigterm_still_stops(big):
    """A background job starts with SIGINT ignored: the server keeps it so, and SIGTERM still stops it."""
    import signal

    path, _, _ = big
    proc, _ = _start_json_server(path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        proc.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and json.loads(out)["served"] == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stop_signal_right_after_the_address_is_printed_still_stops_gracefully(big):
    """A script reads the JSON address and may stop the server at once: SIGTERM then already stops it gracefully
    (exit 0, counters printed), not with the default action of a signal no one handles yet."""
    import signal

    path, _, _ = big
    proc, _ = _start_json_server(path)
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, (proc.returncode, err)
        assert json.loads(out)["served"] == 0 and "served 0 requests" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
