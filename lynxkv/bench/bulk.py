"""Competing bulk traffic for the network lab: one unmarked TCP stream of zeros, bounded in time and in bytes.

Run as a script by its path (standard library only, so it starts in milliseconds inside a namespace)::

    python bulk.py recv HOST SECONDS
        listens on HOST (port chosen by the kernel), prints ``ready PORT``, takes one connection and discards what
        arrives until the sender closes or SECONDS pass; prints ``{"received": n, "seconds": t}`` (t from the
        first byte to the last)
    python bulk.py send HOST PORT SECONDS MAX_BYTES
        sends zeros until SECONDS pass, MAX_BYTES are out, the link stops taking them for SECONDS, or SIGTERM;
        prints ``{"sent": n, "seconds": t}``

Neither sets a TOS byte: the stream lands in the lab's default (unmarked) class.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import time

CHUNK = 64 * 1024
GRACE_S = 5.0  # the receiver outlives the sender's deadline by this much, so it sees the sender's close


class _Stopped(Exception):
    pass


def _stop(*_) -> None:
    raise _Stopped


def receive(host: str, seconds: float) -> dict:
    deadline = time.monotonic() + seconds + GRACE_S
    n, first, last = 0, None, None
    with socket.create_server((host, 0)) as srv:
        print(f"ready {srv.getsockname()[1]}", flush=True)
        srv.settimeout(seconds + GRACE_S)
        try:
            conn, _ = srv.accept()
        except (OSError, _Stopped):
            return {"received": 0, "seconds": 0.0}  # nobody connected in time, or the lab stopped the stream
    with conn:
        try:
            while (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                got = len(conn.recv(CHUNK))
                if not got:
                    break
                last = time.monotonic()
                first = first or last
                n += got
        except (OSError, _Stopped):
            pass
    return {"received": n, "seconds": (last - first) if first is not None else 0.0}


def send(host: str, port: int, seconds: float, max_bytes: int) -> dict:
    start = time.monotonic()
    deadline = start + seconds
    zeros = bytes(CHUNK)
    n = 0
    try:
        with socket.create_connection((host, port), timeout=seconds) as sock:
            while n < max_bytes and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                n += sock.send(zeros[:max_bytes - n])
    except (OSError, _Stopped):
        pass  # the deadline passed inside a send, the peer went away, or the lab stopped the stream
    return {"sent": n, "seconds": time.monotonic() - start}


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop)
    if argv[:1] == ["recv"] and len(argv) == 3:
        result = receive(argv[1], float(argv[2]))
    elif argv[:1] == ["send"] and len(argv) == 5:
        result = send(argv[1], int(argv[2]), float(argv[3]), int(argv[4]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
