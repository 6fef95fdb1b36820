"""The network lab (lynxkv.bench.netlab) on this machine: a cache served in one namespace and streamed from the
other over the shaped veth link arrives byte for byte at the link's rate; the rate can change; the link can be
cut and restored; competing bulk traffic keeps its bounds; and no namespace outlives its lab, whether the ``with``
ends normally, by an exception, by SIGTERM or SIGINT, or (with ``cleanup_stale``) by SIGKILL. Needs root and iproute2;
skips with the reason otherwise."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from lynxkv import save_cache, verify_file
from lynxkv.bench.netlab import NetLab, can_create_lab

pytestmark = pytest.mark.network


@pytest.fixture(scope="module", autouse=True)
def lab_possible():
    reason = can_create_lab()
    if reason is not None:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _gone(pid: int) -> bool:
    """The process has exited (an orphan nobody reaps stays a zombie: exited all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _json_object(text: str) -> dict:
    """The JSON object ``lynxkv ... --json`` printed (it spans several lines), from its first ``{`` line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("{"))
    return json.loads("\n".join(lines[start:]))


@pytest.mark.timing
def test_a_cache_streamed_over_the_lab_arrives_whole_at_the_links_rate(tmp_path):
    rate_bits = 40e6
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(4, 1024, 64, generator=g), torch.randn(4, 1024, 64, generator=g)) for _ in range(4)]
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    src = tmp_path / "src" / "x.lynx"
    save_cache(src, kv)  # about 2.2 MB: half a second on the link
    with NetLab(rate="40Mbit", shape=("server",)) as lab:
        server = lab.popen("server", [sys.executable, "-m", "lynxkv", "serve", src, "--host", lab.server_addr,
                                      "--port", "0", "--once", "--json"], stdout=subprocess.PIPE, text=True)
        lines: list[str] = []
        while not lines or lines[-1] != "}\n":
            lines.append(server.stdout.readline())
            assert lines[-1], "lynxkv serve exited before it printed its address"
        url = json.loads("".join(lines))["url"]
        assert url.startswith(f"http://{lab.server_addr}:")
        got = lab.run("client", [sys.executable, "-m", "lynxkv", "stream", url, "-o", tmp_path / "out" / "copy.lynx",
                                 "--json"], timeout=60)
        assert server.wait(timeout=30) == 0
        server.stdout.close()
        names = {lab.server_ns, lab.client_ns}
        assert names <= _namespaces()
    assert not names & _namespaces()
    report = _json_object(got.stdout)
    assert verify_file(tmp_path / "out" / "copy.lynx") == []
    assert filecmp.cmp(src, tmp_path / "out" / "copy.lynx", shallow=False)
    assert filecmp.cmp(tmp_path / "src" / "x.lynxr", tmp_path / "out" / "x.lynxr", shallow=False)
    rate = report["total_rate"] * 8  # bits/s, from the first byte of the anchor to the last of the residual
    print(f"{report['anchor_bytes'] + report['residual_bytes']:,} bytes at {rate / 1e6:.1f} Mbit/s on a "
          f"{rate_bits / 1e6:.0f} Mbit/s link")  # shown with pytest -s
    assert 0.5 * rate_bits <= rate <= 1.1 * rate_bits


@pytest.mark.timing
def test_set_rate_changes_what_bulk_traffic_gets_and_the_byte_bound_holds():
    with NetLab(rate="10Mbit", shape=("server",)) as lab:
        slow = lab.start_bulk(seconds=1.5).wait()
        lab.set_rate("40Mbit")
        fast = lab.start_bulk(seconds=1.5).wait()
        capped = lab.start_bulk(seconds=10, max_bytes=300_000).wait()
    for got, bits in ((slow, 10e6), (fast, 40e6)):
        measured = got["received"] * 8 / got["receive_seconds"]
        assert 0.5 * bits <= measured <= 1.1 * bits, (got, bits)
        assert got["received"] == got["sent"]
    assert capped["sent"] == capped["received"] == 300_000
    assert capped["send_seconds"] < 5  # it stopped at its byte bound, not at its deadline


CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"
LISTEN = ("import socket, sys, time; s = socket.create_server((sys.argv[1], 0), backlog=64); "
          "print(s.getsockname()[1], flush=True); time.sleep(60)")


def test_link_down_cuts_the_link_and_link_up_restores_it():
    with NetLab(rate="20Mbit") as lab:
        listener = lab.popen("server", [sys.executable, "-c", LISTEN, lab.server_addr], stdout=subprocess.PIPE,
                             text=True)
        port = listener.stdout.readline().strip()
        connect = [sys.executable, "-c", CONNECT, lab.server_addr, port]
        assert lab.run("client", connect, check=False).returncode == 0
        lab.link_down()
        assert lab.run("client", connect, check=False).returncode != 0
        lab.link_up()
        assert lab.run("client", connect, check=False).returncode == 0
        listener.stdout.close()


def test_an_exception_inside_the_lab_leaves_no_namespace_and_no_process():
    with pytest.raises(RuntimeError, match="inside the lab"):
        with NetLab() as lab:
            names = {lab.server_ns, lab.client_ns}
            sleeper = lab.popen("client", ["sleep", "60"])
            assert names <= _namespaces()
            raise RuntimeError("inside the lab")
    assert not names & _namespaces()
    assert sleeper.poll() is not None


# A process that builds a lab, starts a program inside it, says the names and the program's pid, and waits.
CHILD = textwrap.dedent("""
    import time
    from lynxkv.bench.netlab import NetLab
    with NetLab(rate="10Mbit") as lab:
        sleeper = lab.popen("server", ["sleep", "60"])
        print(lab.server_ns, lab.client_ns, sleeper.pid, flush=True)
        time.sleep(60)
""")


def _child_with_a_lab() -> tuple[subprocess.Popen, set[str], int]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    server_ns, client_ns, pid = child.stdout.readline().split()
    names = {server_ns, client_ns}
    assert names <= _namespaces()
    return child, names, int(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_lab_process_stopped_by_a_signal_leaves_no_namespace(sig):
    child, names, sleeper = _child_with_a_lab()
    child.send_signal(sig)
    assert child.wait(timeout=30) == -sig  # it still dies of the signal (SIGINT: as Python does), after the teardown
    child.stdout.close()
    assert not names & _namespaces()
    assert _gone(sleeper)


def test_cleanup_stale_removes_the_lab_of_a_killed_process_and_nothing_else():
    with NetLab() as mine:
        child, names, sleeper = _child_with_a_lab()
        child.kill()  # SIGKILL: no handler runs, the lab stays behind
        child.wait(timeout=30)
        child.stdout.close()
        left = names & _namespaces()  # both, unless a lab built meanwhile by a parallel test run cleaned them
        removed = NetLab.cleanup_stale()
        assert left <= set(removed)
        assert not names & _namespaces()
        assert _gone(sleeper)
        assert {mine.server_ns, mine.client_ns} <= _namespaces()  # a live process's lab stays


def test_can_create_lab_gives_the_reason_it_cannot():
    code = textwrap.dedent("""
        import os
        from lynxkv.bench import netlab
        os.environ["PATH"] = "/nonexistent"
        print(netlab.can_create_lab())
        netlab.can_create_lab.cache_clear()
        os.setuid(65534)
        print(netlab.can_create_lab())
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert got.returncode == 0, got.stderr
    no_ip, not_root = got.stdout.splitlines()
    assert no_ip == "iproute2's 'ip' is not installed"
    assert not_root.startswith("needs root")
