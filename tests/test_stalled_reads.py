"""The reader's stall bound (lynxkv.stream.range_stream): a stall is time in which a read is outstanding and gets
nothing, not time spent queued. On a real HTTP server (loopback), ``lynxkv serve --bandwidth`` sends the anchor
strictly before the residual, so the residual's first request, issued while the anchor is still arriving, gets no
byte until the anchor's last: with one attempt per read (a reader that gives up at its first stall) and a stall
bound much shorter than the anchor's transfer, the load completes, nothing read twice, from a server that exits
once every byte went out once (``--once``) and could not have answered a retry. With a fetch of our own: reads
waiting their turn on a stream that moves are not stalled; one that gets nothing once it may go is."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from cli_helpers import served_url
from runner_helpers import prompt_ids, store_prefill

from lynxkv.errors import TransientError
from lynxkv.storage import RetryPolicy
from lynxkv.stream.link import RESIDUAL
from lynxkv.stream.progressive import open_progressive
from lynxkv.stream.range_stream import RangeStream

pytestmark = pytest.mark.network

STALL_S = 1.0
RATE = "1Mbps"  # the anchor (~290 KB) takes ~2.4 s: well past the stall bound


def _serve(*argv: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "lynxkv", "serve", *argv, "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, served_url(proc)


def test_a_residual_queued_behind_a_slow_anchor_is_not_a_stall(tmp_path):
    from conftest import make_tiny_llama

    path = str(tmp_path / "c.lynx")
    full = store_prefill(make_tiny_llama(4, layers=3, head_dim=32), prompt_ids(6, 1200), path)
    server, url = _serve(path, "--bandwidth", RATE, "--once")
    try:
        t0 = time.monotonic()
        # small blocks, two in flight: every anchor block finishes well within the stall bound, the whole anchor
        # does not
        load = open_progressive(url, retry=RetryPolicy(attempts=1, stall_timeout=STALL_S), block_size=16 << 10,
                                inflight=2)
        try:
            got = load.residual.result(60)
            took = time.monotonic() - t0
            retries = load.timeline.extra["retries"]
        finally:
            load.close()
        assert server.wait(timeout=30) == 0  # --once: every byte went out once
    finally:
        server.kill()
        server.communicate()
    assert took > 2 * STALL_S  # the residual did wait behind the anchor for longer than the stall bound
    assert retries == []
    for (gk, gv), (wk, wv) in zip(got, full, strict=True):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def _one_connection(data: bytes, seconds_per_block: float, gate: threading.Event | None = None):
    """A fetch whose reads share one slow connection: each waits for the ones before it, then takes its time."""
    line = threading.Lock()

    def fetch(a: int, b: int) -> bytes:
        if gate is not None:
            gate.wait()
        with line:
            time.sleep(seconds_per_block)
            return data[a:b]
    return fetch


def test_reads_waiting_their_turn_on_a_moving_stream_are_not_stalled():
    """Three reads in flight on one connection: the third lands 3 block-times after it was issued, more than the
    stall bound, but a block of its stream landed within every bound: nothing is read twice."""
    data = bytes(range(256)) * 48
    src = RangeStream("mem", 0, len(data), stream=RESIDUAL, segment="residual", block_size=1024, inflight=3,
                      fetch=_one_connection(data, 0.3), retry=RetryPolicy(attempts=1, stall_timeout=0.5))
    assert b"".join(d for _, d in src) == data and src.retries == 0


def test_a_read_queued_behind_a_higher_priority_is_not_stalled_until_it_may_go():
    """The residual's read waits for the anchor (``after``) longer than the stall bound: not a stall. Once the
    anchor is in, a read that still gets nothing is one, and is issued again."""
    data = bytes(range(256)) * 4
    anchor_in = threading.Event()
    threading.Timer(1.0, anchor_in.set).start()
    src = RangeStream("mem", 0, len(data), stream=RESIDUAL, segment="residual", after=anchor_in,
                      fetch=_one_connection(data, 0.05, gate=anchor_in), retry=RetryPolicy(attempts=1,
                                                                                           stall_timeout=0.3))
    assert b"".join(d for _, d in src) == data

    silent = threading.Event()  # never set: a server that keeps the request and sends nothing
    src = RangeStream("mem", 0, len(data), stream=RESIDUAL, segment="residual", after=anchor_in,
                      fetch=_one_connection(data, 0.05, gate=silent), retry=RetryPolicy(attempts=2, base=0.01,
                                                                                         stall_timeout=0.3))
    t0 = time.monotonic()
    with pytest.raises(TransientError, match="residual segment.*failed after 2 attempts: stalled: no answer for 0.3 s"):
        list(src)
    assert time.monotonic() - t0 < 2.0


@contextlib.contextmanager
def _silent_server():
    """The URL of a cache on a server that takes every connection and request and sends nothing back."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []  # the accepted connections, kept open and silent until the test ends

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/c.lynx"
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert held, "nothing connected"


def test_a_load_gives_up_on_a_server_that_never_answers_after_its_retries():
    """Its first request (the anchor's size) gets nothing: the load fails after its attempts at the stall bound."""
    with _silent_server() as url:
        t0 = time.monotonic()
        load = open_progressive(url, retry=RetryPolicy(attempts=2, base=0.01, stall_timeout=0.5))
        try:
            with pytest.raises(TransientError, match="failed after 2 attempts.*did not arrive within 0.5 s"):
                load.wait_anchor(30)
        finally:
            load.close()
        assert time.monotonic() - t0 < 5


def test_run_gives_up_on_a_server_that_never_answers_at_its_anchor_timeout(tmp_path):
    """``lynxkv run --anchor-timeout`` ends with one error line at that bound (the transport alone would try for
    longer), and the process exits though its read is still stalled."""
    from conftest import make_tiny_llama
    from runner_helpers import save_tiny_model_dir

    model_dir = save_tiny_model_dir(make_tiny_llama(4, layers=2, head_dim=32), tmp_path / "model")
    timeout = 2.0
    with _silent_server() as url:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "lynxkv", "run", url, "--model", model_dir, "--anchor-timeout",
                               str(timeout), "--json"], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    assert proc.returncode == 1 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"lynxkv: error: the anchor did not arrive within {timeout:g} s"], proc.stderr
    assert took < timeout + 30  # the bound, plus the interpreter's start on a loaded machine
