"""The server's outgoing link (:class:`Egress`): strict anchor priority, round robin within a class, paced.

Priority and fairness. With a rate (``bandwidth``) every response goes through one :class:`Egress`: a chunk of
``quantum`` bytes at a time, anchor chunks strictly before residual chunks and those before exact chunks (format
1.4), first come first served within a class. A response asks for its next chunk only after the previous one was taken by the client's socket, so a
client that stops reading stops asking: it holds no place in the queue and delays no one (the starvation of a
"hold the link for the whole segment" design). Within a class the queue is round robin between connections.
Without a rate nothing is paced; the order is then the network's: each resource's packets carry its DSCP class
(``IP_TOS`` set on the connection's socket before each response, so one keep-alive connection can carry both),
which a shaped link (tests/test_stream_netns.py) or a router honours.
"""

from __future__ import annotations

import asyncio
import collections

from lynxkv.stream.link import STREAMS, TokenBucket

QUANTUM = 64 << 10  # bytes per grant: 2.6 ms at 200 Mbit/s, so a residual chunk delays an anchor by little


class Egress:
    """The server's outgoing link: grants of ``quantum`` bytes, anchor before residual before exact, FIFO within a
    class (round robin between the responses that are ready), paced by a token bucket when ``rate`` is set.

    Only a response that is ready to write waits here; a blocked or idle client is not in any queue."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._bucket = TokenBucket(rate, max(QUANTUM, int(rate * 0.005))) if rate else None
        self._queues = tuple(collections.deque() for _ in STREAMS)  # by class: anchor, residual, exact
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues)

    async def grant(self, cls: int, nbytes: int) -> None:
        if self._bucket is None:
            await asyncio.sleep(0)  # no pacing; still let the other responses run between chunks
            return
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        fut = loop.create_future()
        self._queues[cls].append((fut, nbytes))
        self._wake.set()
        await fut  # on cancellation the future is cancelled and the dispatcher skips it

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = None
            for q in self._queues:  # ANCHOR first
                while q and item is None:
                    fut, n = q.popleft()
                    if not fut.done():
                        item = (fut, n)
                if item:
                    break
            if item is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            fut, n = item
            # No restart after an empty queue: between two chunks of one response the queue is empty while the
            # chunk is written, and restarting would charge that time again; the bucket's cap (a few ms of link
            # time) already keeps an idle spell from turning into a burst.
            wait = self._bucket.debit(n, loop.time())
            if wait > 0:
                await asyncio.sleep(wait)
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
