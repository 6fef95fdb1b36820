"""A real shaped link: a network namespace joined to the host by a veth pair, its egress shaped by the kernel
(tc HTB at 20 Mbit/s, one class per DSCP class: EF borrows first, everything else after). ``lynxkv serve`` (HTTP)
runs inside the namespace without a rate of its own, so both responses are sent at once and only the DSCP marks
decide: marked, the anchor finishes in about anchor_bytes / rate; unmarked, it shares the link with the residual
and finishes much later. Needs root and iproute2 (``ip netns``, ``tc``); skips with the reason otherwise."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest
from fixtures_s3 import synthetic_cache_bytes, write_pair

pytestmark = [pytest.mark.network, pytest.mark.timing]

RATE_BITS = 20e6


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def shaped_namespace():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace")
    if not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("iproute2 (ip, tc) is not installed")
    ns, host_if, ns_if = f"lynx{os.getpid()}", f"lxh{os.getpid() % 100000}", f"lxn{os.getpid() % 100000}"
    net = f"10.77.{os.getpid() % 250}"  # a subnet of its own: another run at the same time must not clash
    try:
        _sh("ip", "netns", "add", ns)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"ip netns is unavailable here: {getattr(exc, 'stderr', exc)}")
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", ns)
        _sh("ip", "addr", "add", f"{net}.2/24", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{net}.1/24", "dev", ns_if)
        _sh("ip", "-n", ns, "link", "set", ns_if, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        tc = ("tc", "-n", ns)
        _sh(*tc, "qdisc", "add", "dev", ns_if, "root", "handle", "1:", "htb", "default", "30", "r2q", "100")
        _sh(*tc, "class", "add", "dev", ns_if, "parent", "1:", "classid", "1:1", "htb", "rate", "20mbit",
            "ceil", "20mbit")
        _sh(*tc, "class", "add", "dev", ns_if, "parent", "1:1", "classid", "1:10", "htb", "rate", "100kbit",
            "ceil", "20mbit", "prio", "0")
        _sh(*tc, "class", "add", "dev", ns_if, "parent", "1:1", "classid", "1:30", "htb", "rate", "100kbit",
            "ceil", "20mbit", "prio", "7")
        _sh(*tc, "filter", "add", "dev", ns_if, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
            "ip", "dsfield", "0xb8", "0xfc", "flowid", "1:10")  # DSCP EF -> the high-priority class
    except (subprocess.CalledProcessError, OSError) as exc:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot build the shaped veth link: {getattr(exc, 'stderr', exc)}")
    try:
        yield ns, f"{net}.1"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # removes the veth pair too
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def _transfer(ns: tuple[str, str], path: str, marks: bool) -> dict:
    ns, addr = ns
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "lynxkv", "serve", path, "--host", addr,
           "--port", "0", "--once", "--json"]
    if marks:
        cmd += ["--dscp-anchor", "EF", "--dscp-residual", "CS1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        while not lines or lines[-1] != "}\n":
            lines.append(proc.stdout.readline())
            assert lines[-1], proc.stderr.read()
        info = json.loads("".join(lines))
        url = urllib.parse.urlsplit(info["url"])
        base = url.path.rsplit("/", 1)[0]
        done: dict = {}
        # Both connections are made first and both requests then sent together, so that neither stream starts
        # ahead by a connection set-up (a skew that let an unmarked anchor through alone now and then).
        t0: list[float] = []
        start = threading.Barrier(2, action=lambda: t0.append(time.perf_counter()))  # before either is let go

        def pull(stream: str, path: str) -> None:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            try:
                conn.connect()
                start.wait(30)
                conn.request("GET", path)
                n = len(conn.getresponse().read())
                done[stream] = (time.perf_counter() - t0[0], n)
            finally:
                conn.close()

        threads = [threading.Thread(target=pull, args=("anchor", url.path)),
                   threading.Thread(target=pull, args=("residual", f"{base}/{info['residual']['path']}"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=30) == 0
        return done
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_dscp_marked_anchor_gets_through_first_on_a_shaped_link(tmp_path, shaped_namespace):
    anchor, residual = synthetic_cache_bytes(layers=2, heads=2, tokens=1024, dim=128)  # ~0.66 + 0.52 MB
    path = write_pair(tmp_path, anchor, residual)
    marked = _transfer(shaped_namespace, path, marks=True)
    plain = _transfer(shaped_namespace, path, marks=False)
    print(f"anchor/residual done, marked EF/CS1: {marked['anchor'][0]:.2f}/{marked['residual'][0]:.2f} s; "
          f"unmarked: {plain['anchor'][0]:.2f}/{plain['residual'][0]:.2f} s")  # shown with pytest -s
    alone = len(anchor) * 8 / RATE_BITS  # the anchor by itself on the shaped link
    both = (len(anchor) + len(residual)) * 8 / RATE_BITS
    assert marked["anchor"][1] == len(anchor) and marked["residual"][1] == len(residual)
    assert marked["anchor"][0] < marked["residual"][0]
    assert marked["anchor"][0] < alone + 0.35 * (both - alone)  # close to having the link to itself
    assert plain["anchor"][0] > marked["anchor"][0] + 0.3 * (both - alone)  # unmarked, it has to share
