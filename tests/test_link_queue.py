"""The shared link of a batch: whole caches (anchor, then residual) one at a time in the policy's order."""

from __future__ import annotations

import threading
import time

import pytest

from lynxkv.errors import InputError
from lynxkv.stream.link import ANCHOR, RESIDUAL
from lynxkv.bench.link_queue import LinkQueue


def _transfer(queue, sizes, *, anchor=20_000, block=10_000, late=()):
    """Each load sends its anchor then its residual in blocks, from its own thread (as the transports do); the
    loads in ``late`` start sending a little after the others. Returns the order caches finished and the blocks
    sent, in the order they went."""
    lanes = [queue.lane(anchor + size, name=str(i)) for i, size in enumerate(sizes)]
    done, events = [], []
    lock = threading.Lock()
    for lane in lanes:
        lane.join()

    def load(i, lane):
        if i in late:
            time.sleep(0.05)
        for stream, nbytes in ((ANCHOR, anchor), (RESIDUAL, sizes[i])):
            for _ in range(nbytes // block):
                lane.send(stream, block)
                with lock:
                    events.append((stream, i))
        with lock:
            done.append(i)

    threads = [threading.Thread(target=load, args=(i, lane)) for i, lane in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return done, events


@pytest.mark.parametrize("policy", ["fifo", "srf"])
def test_one_whole_cache_at_a_time_in_the_policys_order(policy):
    sizes = [60_000, 20_000, 40_000, 10_000]
    done, events = _transfer(LinkQueue(2e6, policy=policy), sizes, late=(3,))
    owners = [i for _, i in events]
    # one cache at a time: each load's blocks are contiguous, its anchor before its residual
    assert [i for j, i in enumerate(owners) if j == 0 or owners[j - 1] != i] == done
    for i in done:
        streams = [stream for stream, owner in events if owner == i]
        assert streams == sorted(streams, key=lambda s: s != ANCHOR) and len(streams) == 2 + sizes[i] // 10_000
    # srf waits for the late small one (it has joined) instead of starting a larger one
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
