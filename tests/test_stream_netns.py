"""DSCP marks on a real shaped link (lynxkv.bench.netlab): ``lynxkv serve`` (HTTP) runs in the lab's server
namespace without a rate of its own, a client in the client namespace asks for the anchor and the residual at the
same moment, and the kernel (tc HTB at 20 Mbit/s, one class per DSCP class) alone decides who goes first. The
class counters show where the bytes went (EF to the anchor's class, CS1 to the residual's, unmarked to the
default class). Marked EF, the anchor finishes in about anchor_bytes / rate; unmarked, it shares the link with
the residual and finishes much later; marked, with unmarked bulk traffic competing, it still has the link almost
to itself. Needs root and iproute2; skips with the reason otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse

import pytest
from cli_helpers import served_url
from fixtures_s3 import synthetic_cache_bytes, write_pair

from lynxkv.bench.netlab import NetLab, can_create_lab

pytestmark = [pytest.mark.network, pytest.mark.timing]

RATE_BITS = 20e6

# Runs inside the client namespace (standard library only). Both connections are made first and both requests then
# sent together, so that neither stream starts ahead by a connection set-up (a skew that let an unmarked anchor
# through alone now and then). Prints {stream: [seconds from the common start, bytes]}.
PULL_BOTH = r"""
import http.client, json, sys, threading, time
host, port, anchor, residual = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
done, t0 = {}, []
start = threading.Barrier(2, action=lambda: t0.append(time.perf_counter()))
def pull(stream, path):
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.connect()
        start.wait(30)
        conn.request("GET", path)
        n = len(conn.getresponse().read())
        done[stream] = [time.perf_counter() - t0[0], n]
    finally:
        conn.close()
threads = [threading.Thread(target=pull, args=("anchor", anchor)),
           threading.Thread(target=pull, args=("residual", residual))]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print(json.dumps(done))
"""


@pytest.fixture(scope="module")
def lab():
    reason = can_create_lab()
    if reason is not None:
        pytest.skip(reason)
    with NetLab(rate=f"{int(RATE_BITS)}bit", shape=("server",)) as lab:
        yield lab


def _transfer(lab: NetLab, path: str, marks: bool) -> dict:
    cmd = [sys.executable, "-m", "lynxkv", "serve", path, "--host", lab.server_addr, "--port", "0", "--once",
           "--json"]
    if marks:
        cmd += ["--dscp-anchor", "EF", "--dscp-residual", "CS1"]
    before = lab.class_bytes("server")
    proc = lab.popen("server", cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        while not lines or lines[-1] != "}\n":
            lines.append(proc.stdout.readline())
            assert lines[-1], proc.stderr.read()
        info = json.loads("".join(lines))
        url = urllib.parse.urlsplit(info["url"])
        residual_path = f"{url.path.rsplit('/', 1)[0]}/{info['residual']['path']}"
        pulled = lab.run("client", [sys.executable, "-c", PULL_BOTH, url.hostname, url.port, url.path,
                                    residual_path], timeout=60)
        assert proc.wait(timeout=30) == 0
        after = lab.class_bytes("server")
        return {**json.loads(pulled.stdout), "classes": {k: after[k] - before[k] for k in after}}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_dscp_marked_anchor_gets_through_first_on_a_shaped_link(tmp_path, lab):
    anchor, residual = synthetic_cache_bytes(layers=2, heads=2, tokens=1024, dim=128)  # ~0.66 + 0.52 MB
    path = write_pair(tmp_path, anchor, residual)
    marked = _transfer(lab, path, marks=True)
    plain = _transfer(lab, path, marks=False)
    bulk = lab.start_bulk(seconds=20, max_bytes=RATE_BITS // 8 * 20)
    try:
        crowded = _transfer(lab, path, marks=True)
    finally:
        competing = bulk.stop()
    print(f"anchor/residual done, marked EF/CS1: {marked['anchor'][0]:.2f}/{marked['residual'][0]:.2f} s; "
          f"unmarked: {plain['anchor'][0]:.2f}/{plain['residual'][0]:.2f} s; marked beside bulk traffic: "
          f"{crowded['anchor'][0]:.2f}/{crowded['residual'][0]:.2f} s")  # shown with pytest -s
    alone = len(anchor) * 8 / RATE_BITS  # the anchor by itself on the shaped link
    both = (len(anchor) + len(residual)) * 8 / RATE_BITS
    for run in (marked, plain, crowded):
        assert run["anchor"][1] == len(anchor) and run["residual"][1] == len(residual)
    # Where the kernel put the bytes: by their marks, or all in the default class without them.
    assert marked["classes"]["anchor"] >= len(anchor) and marked["classes"]["residual"] >= len(residual)
    assert plain["classes"]["anchor"] == plain["classes"]["residual"] == 0
    assert plain["classes"]["bulk"] >= len(anchor) + len(residual)
    assert marked["anchor"][0] < marked["residual"][0]
    assert marked["anchor"][0] < alone + 0.35 * (both - alone)  # close to having the link to itself
    assert plain["anchor"][0] > marked["anchor"][0] + 0.3 * (both - alone)  # unmarked, it has to share
    assert competing["received"] > 0  # the bulk stream did run beside the transfer
    assert crowded["anchor"][0] < alone + 0.35 * (both - alone)  # bulk traffic does not hold the anchor back


def test_a_connections_handshake_goes_in_the_anchors_class(tmp_path, lab):
    """The server's side of a new connection (its SYN-ACK) carries the anchor's mark: a decoder's first request
    does not wait behind other traffic in the default class for its connection."""
    anchor, residual = synthetic_cache_bytes(layers=1, heads=1, tokens=64, dim=64)
    path = write_pair(tmp_path, anchor, residual)
    proc = lab.popen("server", [sys.executable, "-m", "lynxkv", "serve", path, "--host", lab.server_addr, "--port",
                                "0", "--json", "--dscp-anchor", "EF", "--dscp-residual", "CS1"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = urllib.parse.urlsplit(served_url(proc))
        connect = [sys.executable, "-c", "import socket, sys, time; socket.create_connection((sys.argv[1], "
                   "int(sys.argv[2])), timeout=10).close(); time.sleep(0.5)", url.hostname, str(url.port)]
        lab.run("client", connect, timeout=60)  # once before counting: the neighbours' addresses (ARP) are known
        before = lab.class_bytes("server")
        lab.run("client", connect, timeout=60)  # (its wait: the server's FIN after the client's)
        after = lab.class_bytes("server")
    finally:
        proc.kill()
        proc.communicate()
    sent = {k: after[k] - before[k] for k in after}
    assert sent["anchor"] > 0 and sent["bulk"] == 0 and sent["residual"] == 0, sent
