"""The shared link of a batch: anchors before any residual, then residuals one at a time in the policy's order."""

from __future__ import annotations

import threading
import time

import pytest

from lynxkv.errors import InputError
from lynxkv.stream.link import ANCHOR, RESIDUAL
from lynxkv.bench.link_queue import LinkQueue


def _transfer(queue, sizes, *, anchor=20_000, block=10_000, late=()):
    """Each load sends its anchor then its residual in blocks, from its own thread (as the transports do); the
    loads in ``late`` start their residual a little after the others. Returns the order residuals finished."""
    lanes = [queue.lane(size, name=str(i)) for i, size in enumerate(sizes)]
    done, events = [], []
    lock = threading.Lock()
    for lane in lanes:
        lane.join()

    def load(i, lane):
        for _ in range(anchor // block):
            lane.send(ANCHOR, block)
            with lock:
                events.append(("anchor", i))
        if i in late:
            time.sleep(0.05)
        sent = 0
        while sent < sizes[i]:
            lane.send(RESIDUAL, block)
            sent += block
            with lock:
                events.append(("residual", i))
        with lock:
            done.append(i)

    threads = [threading.Thread(target=load, args=(i, lane)) for i, lane in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return done, events


@pytest.mark.parametrize("policy", ["fifo", "srf"])
def test_anchors_first_then_one_residual_at_a_time(policy):
    sizes = [60_000, 20_000, 40_000, 10_000]
    done, events = _transfer(LinkQueue(2e6, policy=policy), sizes, late=(3,))
    last_anchor = max(i for i, e in enumerate(events) if e[0] == "anchor")
    first_residual = min(i for i, e in enumerate(events) if e[0] == "residual")
    assert last_anchor < first_residual
    runs = [i for kind, i in events if kind == "residual"]
    # one residual at a time: each load's residual blocks are contiguous
    assert [i for j, i in enumerate(runs) if j == 0 or runs[j - 1] != i] == done
    # srf waits for the late short one (it has joined) instead of starting a longer one
    assert done == ([0, 1, 2, 3] if policy == "fifo" else [3, 1, 2, 0])


def test_a_released_lane_passes_the_turn():
    queue = LinkQueue(2e6, policy="srf")
    stuck = queue.lane(1_000, name="stuck")  # joined, but its load failed before sending anything
    stuck.join()
    other = queue.lane(50_000, name="other")
    threading.Timer(0.05, stuck.release).start()
    t = time.perf_counter()
    other.send(RESIDUAL, 10_000)
    assert time.perf_counter() - t >= 0.04 and queue.order == ["other"]


def test_unknown_policy():
    with pytest.raises(InputError, match="fifo, srf"):
        LinkQueue(1e6, policy="random")
