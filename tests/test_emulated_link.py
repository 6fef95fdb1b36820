"""Units, the emulated link (one shared token bucket, strict anchor priority) and ordered range sources."""

from __future__ import annotations

import threading
import time

import pytest

from lynxkv.errors import InputError
from lynxkv.bench.emulated_link import EmulatedLink
from lynxkv.stream.link import ANCHOR, RESIDUAL
from lynxkv.storage import RetryPolicy
from lynxkv.stream.transport import RangeStream
from lynxkv.stream.units import format_rate, format_seconds, parse_bandwidth, parse_duration


@pytest.mark.parametrize("text,expected", [
    ("1Gbps", 125e6), ("500Mbps", 62.5e6), ("100MB/s", 100e6), ("1MiB/s", 2.0**20), ("8kbps", 1e3),
    ("2.5 Gbit/s", 312.5e6), ("10 B/s", 10.0), (1000, 1000.0),
], ids=lambda v: str(v))
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "10", "-1Gbps", "0Mbps", "1Gbpx"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(InputError, match="bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text,expected", [("2ms", 0.002), ("150us", 150e-6), ("1.5s", 1.5), ("0.25", 0.25)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


def test_parse_duration_rejects():
    with pytest.raises(InputError, match="duration"):
        parse_duration("soon")


def test_format_rate():
    assert format_rate(125e6) == "1.00 Gbit/s"
    assert format_rate(None) == "unlimited"


def test_format_seconds():
    assert format_seconds(1.5) == "1.500 s"
    assert format_seconds(0.0123, "ms") == "12.3 ms"
    assert format_seconds(None) == "-"


def _send_all(link, stream, total, block, done):
    sent = 0
    while sent < total:
        n = min(block, total - sent)
        link.send(stream, n)
        sent += n
    done[stream] = link.now()


@pytest.mark.timing
def test_strict_priority_and_shared_rate():
    """Both streams start together: the residual only gets the link after the anchor's last byte, and the two
    together move at the configured rate (one bucket, not one each)."""
    link = EmulatedLink(50e6)  # 400 Mbit/s
    done: dict = {}
    threads = [threading.Thread(target=_send_all, args=(link, s, 6_000_000, 1 << 20, done))
               for s in (RESIDUAL, ANCHOR)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep = link.report()
    # The residual may have been granted one quantum before the anchor thread arrived; never more.
    assert rep["residual"]["bytes"] == 6_000_000
    assert done[ANCHOR] < done[RESIDUAL]
    assert done[ANCHOR] == pytest.approx(6_000_000 / 50e6, rel=0.2, abs=0.02)
    assert rep["total"]["rate"] == pytest.approx(50e6, rel=0.10)


@pytest.mark.timing
def test_a_sender_late_between_blocks_loses_no_link_time():
    """A reader hands each block to the next sender a few ms late, or wakes late within a block, as the reader's
    threads do while a forward holds both cores: a real link keeps moving bytes into the receiver's socket buffer
    meanwhile, so the transfer still ends when the rate says. It never ends sooner."""
    rate, block, blocks = 10e6, 100_000, 20  # 2 MB, 0.2 s on the wire
    link = EmulatedLink(rate, quantum=25_000)
    t0 = time.perf_counter()
    for i in range(blocks):
        link.send(RESIDUAL, block)
        time.sleep(0.004)  # the hand-over: 80 ms of gaps in all, each far under the idle spell
    elapsed = time.perf_counter() - t0 - 0.004  # the last gap is after the transfer
    ideal = blocks * block / rate
    assert ideal - 0.002 <= elapsed < ideal + 0.03  # losing each gap would take 0.28 s


@pytest.mark.timing
def test_a_transfer_after_an_idle_link_gets_no_credit_for_it():
    link = EmulatedLink(10e6)
    link.send(ANCHOR, 100_000)
    time.sleep(0.1)  # idle: no send waiting for far longer than a hand-over
    t0 = time.perf_counter()
    link.send(RESIDUAL, 200_000)
    assert time.perf_counter() - t0 >= 200_000 / 10e6 - 0.002  # 20 ms: no head start from the idle spell


def test_residual_uses_what_the_anchor_leaves():
    """While the anchor has nothing to send, the residual gets the whole link."""
    link = EmulatedLink(20e6)
    marks = {}

    def anchor():
        link.send(ANCHOR, 200_000)
        marks["gap_start"] = link.stats[RESIDUAL].bytes
        time.sleep(0.1)  # the anchor source stalls
        marks["gap_end"] = link.stats[RESIDUAL].bytes
        link.send(ANCHOR, 200_000)

    t = threading.Thread(target=anchor)
    t.start()
    time.sleep(0.005)
    link.send(RESIDUAL, 4_000_000)
    t.join()
    moved_in_gap = marks["gap_end"] - marks["gap_start"]
    assert moved_in_gap >= 0.5 * 20e6 * 0.1  # at least half of what the link can move in the gap


def test_unlimited_link_keeps_priority_only():
    link = EmulatedLink(None)
    t0 = time.perf_counter()
    link.send(ANCHOR, 10**9)
    assert time.perf_counter() - t0 < 0.5
    assert link.stats[ANCHOR].bytes == 10**9


def test_latency_is_paid_once_per_stream_not_per_block():
    data = bytes(range(256)) * 4096  # 1 MiB
    link = EmulatedLink(100e6, 0.05)
    src = RangeStream("mem", 0, len(data), stream=ANCHOR, segment="anchor", link=link,
                      fetch=lambda a, b: data[a:b], block_size=64 << 10, inflight=8)
    t0 = time.perf_counter()
    got = b"".join(d for _, d in src)
    elapsed = time.perf_counter() - t0
    assert got == data
    serial = len(data) / 100e6
    assert serial + 0.05 <= elapsed + 0.005
    assert elapsed < serial + 0.05 + 0.15  # 16 blocks x 50 ms would be 0.8 s


class _RecordingLink(EmulatedLink):
    """An unlimited link that records which block's bytes it was asked to send, in order."""

    def __init__(self):
        super().__init__(None)
        self.sent: list[int] = []

    def send(self, stream: int, nbytes: int) -> float:
        self.sent.append(nbytes)
        return super().send(stream, nbytes)


def test_blocks_in_flight_take_the_link_in_offset_order():
    # Later blocks answer first; each block's bytes still go on the link after the block before it, as one
    # connection's bytes do. The last block is the short one and answers first: charged as they answer, it
    # would be the first on the link.
    data = bytes(i % 251 for i in range(7500))
    link = _RecordingLink()

    def fetch(a, b):
        time.sleep(0.005 * (8 - a // 1000))
        return data[a:b]

    src = RangeStream("mem", 0, len(data), stream=RESIDUAL, segment="residual", link=link, fetch=fetch,
                      block_size=1000, inflight=8)
    assert b"".join(d for _, d in src) == data
    assert link.sent == [1000] * 7 + [500]


@pytest.mark.timing
def test_a_block_is_handed_over_once_its_own_bytes_are_sent():
    data = bytes(i % 251 for i in range(400_000))
    link = EmulatedLink(4e6, quantum=10_000)  # 100 KB blocks of 25 ms each, charged 10 KB at a time
    src = RangeStream("mem", 0, len(data), stream=RESIDUAL, segment="residual", link=link,
                      fetch=lambda a, b: data[a:b], block_size=100_000, inflight=4)
    t0 = time.perf_counter()
    times = [time.perf_counter() - t0 for _ in src]
    # charged side by side, the four blocks would all end at about 100 ms; in order, the first ends at about 25
    assert times[0] < 0.06 and times[-1] > 0.08


def test_range_source_retries_and_orders_blocks():
    data = bytes(i % 251 for i in range(300_000))
    calls = {"n": 0}

    def flaky(a, b):
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise ConnectionResetError("reset by peer")
        if calls["n"] == 5:
            time.sleep(1.0)  # a stalled request: abandoned after stall_timeout and issued again
        return data[a:b]

    retries = []
    src = RangeStream("mem", 0, len(data), stream=RESIDUAL, segment="residual", fetch=flaky, block_size=32 << 10,
                      inflight=3, retry=RetryPolicy(attempts=4, base=0.01, stall_timeout=0.2),
                      on_retry=retries.append)
    blocks = list(src)
    assert [a for a, _ in blocks] == sorted(a for a, _ in blocks)
    assert b"".join(d for _, d in blocks) == data
    assert len(retries) >= 3


def test_range_source_gives_up_with_a_lynx_error():
    from lynxkv.errors import LynxError

    def down(a, b):
        raise ConnectionRefusedError("connection refused")

    src = RangeStream("mem", 0, 1000, stream=RESIDUAL, segment="residual", fetch=down,
                      retry=RetryPolicy(attempts=3, base=0.01))
    with pytest.raises(LynxError, match="residual segment.*failed after 3 attempts"):
        list(src)


def test_range_source_reports_truncation():
    from lynxkv.errors import FormatError

    data = b"x" * 1000
    src = RangeStream("mem", 0, 2000, stream=RESIDUAL, segment="residual", fetch=lambda a, b: data[a:b],
                      block_size=512, retry=RetryPolicy(attempts=2, base=0.01))
    with pytest.raises(FormatError, match="truncated"):
        list(src)


def test_stream_buffer_is_bounded_and_ordered():
    """The feeder waits while more than ``cap`` bytes are held beyond what the reader released, unless the
    reader is waiting for bytes further on; reads block until their bytes are in."""
    from lynxkv.errors import FormatError
    from lynxkv.stream.buffer import StreamBuffer

    buf = StreamBuffer(10_000, "residual", cap=2_000)
    fed = []

    def feeder():
        for a in range(0, 10_000, 1_000):
            buf.feed(a, bytes([a // 1000]) * 1_000)
            fed.append(a)
        buf.finish()

    t = threading.Thread(target=feeder, daemon=True)
    t.start()
    time.sleep(0.2)
    assert len(fed) == 3  # 3 000 bytes held > cap: the feeder waits
    assert buf.read(500, 1_000) == bytes([0]) * 500 + bytes([1]) * 500
    buf.release(3_000)
    assert buf.read(9_500, 500) == bytes([9]) * 500  # a read far ahead lets the feeder through
    t.join(5)
    assert len(fed) == 10
    with pytest.raises(FormatError, match="already released"):
        buf.read(100, 10)
    with pytest.raises(FormatError, match="out of order"):
        StreamBuffer(10, "x").feed(5, b"a")
