"""A network lab: two network namespaces joined by a veth pair and shaped by the kernel, for the tests and
benchmarks that need a real link (real TCP, real queues, DSCP marks honoured) rather than an emulated one.

``with NetLab(rate="60Mbit") as lab:`` builds

- two namespaces, ``lynxlab-<pid>-<tag>-s`` (server) and ``lynxlab-<pid>-<tag>-c`` (client), loopback up in each;
  ``<pid>`` is the owning process, so that a lab whose process died can be found and removed
  (:meth:`NetLab.cleanup_stale`), ``<tag>`` is random;
- a veth pair, an end called ``lab0`` in each namespace, created inside them (the host's own namespace gets no
  interface, address or route), with a /30 of 10.213.0.0/16 that exists only between these two ends:
  ``lab.server_addr`` and ``lab.client_addr``;
- on the egress of each end (the side that sends: the server's for downloads, the client's for requests) the HTB
  tree of :mod:`lynxkv.bench.shaping`: the link's rate, one child class per DSCP class with ``prio`` 0..7, packets
  steered by ``u32 match ip dsfield``.

Then ``lab.popen(side, argv)`` and ``lab.run(side, argv)`` run programs inside a namespace (``ip netns exec``),
``lab.set_rate`` changes the rate, ``lab.link_down()`` / ``lab.link_up()`` cut and restore the link (fault tests),
``lab.start_bulk()`` starts competing unmarked traffic (:mod:`lynxkv.bench.bulk`).

Teardown. Leaving the ``with`` (normally or by an exception), ``close()``, the interpreter's exit (``atexit``) and
SIGTERM or SIGINT (a handler closes every lab of the process, then does what the signal did before: the default
action, or the handler that was there) stop the processes the lab started, kill any process still inside its
namespaces, and delete both namespaces (which deletes the veth pair). SIGKILL cannot be caught: the next lab
(or ``NetLab.cleanup_stale()``) removes the namespaces of labs whose owning process is gone, with whatever still
runs inside them.

Needs root, iproute2 (``ip``, ``tc``), and a kernel with network namespaces, veth, ``sch_htb`` and ``cls_u32``;
:func:`can_create_lab` says which is missing, for a test to skip with the reason.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

from lynxkv.bench.bulk import GRACE_S
from lynxkv.bench.shaping import LYNX_CLASSES, TrafficClass, htb_commands, parse_class_bytes, parse_rate

PREFIX = "lynxlab-"
DEV = "lab0"
_NAME = re.compile(r"^lynxlab-(\d+)-[0-9a-f]+-[sc]$")
BULK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bulk.py")
IP_TIMEOUT_S = 20


class LabError(RuntimeError):
    """The lab could not be built or changed; the message names the step and what the command said."""


def _ip(*argv: str, step: str) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"cannot {step}: {exc}") from None
    if proc.returncode != 0:
        raise LabError(f"cannot {step}: {' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=IP_TIMEOUT_S).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still inside ``ns`` (programs the lab's users started there) and wait briefly for them
    to go, so that deleting the name also frees the namespace."""
    pids = _netns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if not _exited(p)]
        time.sleep(0.01)


def _exited(pid: int) -> bool:
    """Gone, or a zombie: an orphan that nobody reaps stays one, exited all the same."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _stop_process(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Bulk:
    """A running competing stream: ``wait()`` lets it end by itself, ``stop()`` ends it now; both return what each
    side counted: ``{"sent", "send_seconds", "received", "receive_seconds"}`` (the receiver's seconds run from its
    first byte to its last, so ``received * 8 / receive_seconds`` is the rate the link gave it)."""

    def __init__(self, sender: subprocess.Popen, receiver: subprocess.Popen, seconds: float):
        self.sender, self.receiver, self.seconds = sender, receiver, seconds

    def wait(self) -> dict:
        return self._collect(self.seconds + 10.0)

    def stop(self) -> dict:
        if self.sender.poll() is None:
            self.sender.send_signal(signal.SIGTERM)
        return self._collect(10.0)

    def _collect(self, sender_timeout: float) -> dict:
        sent = _result(self.sender, sender_timeout)
        # The receiver ends when it has drained what the sender's socket still held and sees the close; one that
        # never got a connection is stopped after the same grace (it then reports nothing received).
        received = _result(self.receiver, GRACE_S + 1.0)
        return {"sent": sent.get("sent", 0), "send_seconds": sent.get("seconds"),
                "received": received.get("received", 0), "receive_seconds": received.get("seconds")}


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    """The JSON line a bulk process prints as it ends ({} if it printed none)."""
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_process(proc)
        text, _ = proc.communicate()
    last = (text or "").strip().splitlines()[-1:]
    return json.loads(last[0]) if last and last[0].startswith("{") else {}


class NetLab:
    """Two namespaces, a shaped veth link between them, and what runs inside; see the module docstring."""

    def __init__(self, rate: str | int = "60Mbit", *, classes: tuple[TrafficClass, ...] = LYNX_CLASSES,
                 shape: tuple[str, ...] = ("server", "client")):
        self.rate_bits = parse_rate(rate)
        self.classes = classes
        self.shape = tuple(shape)
        if not set(self.shape) <= {"server", "client"}:
            raise ValueError(f"shape: expected sides 'server' and/or 'client', got {shape!r}")
        tag = secrets.token_hex(3)
        self.server_ns = f"{PREFIX}{os.getpid()}-{tag}-s"
        self.client_ns = f"{PREFIX}{os.getpid()}-{tag}-c"
        # A /30 of 10.213.0.0/16: its two host addresses. It exists only between the two namespaces, so any /30
        # would do; a random one keeps two labs' addresses apart in logs and captures.
        net, host = secrets.randbelow(256), 4 * secrets.randbelow(64)
        self.server_addr, self.client_addr = f"10.213.{net}.{host + 1}", f"10.213.{net}.{host + 2}"
        self._owner = os.getpid()
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False

    # ------------------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> NetLab:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> NetLab:
        """Build the lab (``with`` does it); on any failure what was built is removed and :class:`LabError` says
        which step failed."""
        NetLab.cleanup_stale()
        _register(self)
        try:
            for ns in (self.server_ns, self.client_ns):
                _ip("ip", "netns", "add", ns, step="create a network namespace")
                self._created.append(ns)
                _ip("ip", "-n", ns, "link", "set", "lo", "up", step="bring loopback up")
            _ip("ip", "-n", self.server_ns, "link", "add", DEV, "type", "veth", "peer", "name", DEV, "netns",
                self.client_ns, step="create a veth pair")
            for ns, addr in ((self.server_ns, self.server_addr), (self.client_ns, self.client_addr)):
                _ip("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", DEV, step="address the veth pair")
                _ip("ip", "-n", ns, "link", "set", DEV, "up", step="bring the veth pair up")
            for side in self.shape:
                for cmd in htb_commands(self._ns(side), DEV, self.rate_bits, self.classes):
                    _ip(*cmd, step=f"shape the link ({cmd[3]} {cmd[4]})")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop what the lab started, kill what still runs inside it, delete both namespaces. Idempotent; does
        nothing in a forked child (the lab belongs to the process that built it)."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        for proc in self._procs:
            _stop_process(proc)
        for ns in self._created:
            _kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=IP_TIMEOUT_S)
        self._created.clear()
        _unregister(self)

    @staticmethod
    def cleanup_stale() -> list[str]:
        """Delete the ``lynxlab-*`` namespaces whose owning process (the pid in the name) is gone, killing what the
        dead lab left running inside them; return their names. Labs of live processes are left alone."""
        removed = []
        for ns in _netns_names():
            m = _NAME.match(ns)
            if m is None or _pid_alive(int(m.group(1))):
                continue
            _kill_inside(ns)
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=IP_TIMEOUT_S).returncode == 0:
                removed.append(ns)
        return removed

    # ------------------------------------------------------------------------------------------------ processes

    def _ns(self, side: str) -> str:
        found = {"server": self.server_ns, "client": self.client_ns}.get(side, side)
        if found not in (self.server_ns, self.client_ns):
            raise ValueError(f"namespace {side!r}: expected 'server', 'client' or one of this lab's names")
        return found

    def popen(self, side: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``side`` ('server', 'client' or the namespace's name); ``kwargs`` go to Popen.
        The lab stops it (SIGTERM, then SIGKILL) when it closes."""
        if self._closed or not self._created:
            raise LabError("the lab is not open")
        proc = subprocess.Popen(["ip", "netns", "exec", self._ns(side), *map(str, argv)], **kwargs)
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def run(self, side: str, argv: list[str], *, timeout: float = 60.0, check: bool = True,
            input: str | bytes | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``side`` to completion; output captured as text unless ``kwargs`` say otherwise."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        proc = self.popen(side, argv, stdin=subprocess.PIPE if input is not None else None, **kwargs)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            _stop_process(proc, grace_s=0.0)
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    # ------------------------------------------------------------------------------------------------- the link

    def set_rate(self, rate: str | int) -> None:
        """Change the link's rate on every shaped side; the classes, priorities and filters stay."""
        bits = parse_rate(rate)
        for side in self.shape:
            for cmd in htb_commands(self._ns(side), DEV, bits, self.classes, change=True):
                _ip(*cmd, step="change the link's rate")
        self.rate_bits = bits

    def class_bytes(self, side: str = "server") -> dict[str, int]:
        """Bytes each traffic class of ``side``'s shaped end has sent so far (``"link"``: all of them): where the
        kernel put what was sent, e.g. to check that marked packets met their class; ``{}`` for a side not shaped."""
        out = _ip("tc", "-n", self._ns(side), "-s", "class", "show", "dev", DEV, step="read the class counters")
        return parse_class_bytes(out, self.classes)

    def link_down(self) -> None:
        """Cut the link (the server's end goes down; the client's loses its carrier): packets in either direction
        are dropped until :meth:`link_up`; open TCP connections stay and retransmit."""
        _ip("ip", "-n", self.server_ns, "link", "set", DEV, "down", step="take the link down")

    def link_up(self) -> None:
        _ip("ip", "-n", self.server_ns, "link", "set", DEV, "up", step="bring the link up")

    def start_bulk(self, *, seconds: float = 10.0, max_bytes: int = 1 << 30, from_side: str = "server") -> Bulk:
        """Start one unmarked TCP stream of zeros from ``from_side`` to the other side, ending by itself after
        ``seconds`` or ``max_bytes``; it lands in the default class and competes with what the lab carries."""
        if not (seconds > 0 and max_bytes > 0):
            raise ValueError(f"bulk traffic: seconds and max_bytes must be positive, got {seconds}, {max_bytes}")
        to_side = "client" if self._ns(from_side) == self.server_ns else "server"
        to_addr = self.client_addr if to_side == "client" else self.server_addr
        receiver = self.popen(to_side, [sys.executable, BULK_SCRIPT, "recv", to_addr, seconds],
                              stdout=subprocess.PIPE, text=True)
        ready = receiver.stdout.readline().split()
        if ready[:1] != ["ready"]:
            _stop_process(receiver)
            raise LabError("the bulk receiver did not start")
        sender = self.popen(from_side, [sys.executable, BULK_SCRIPT, "send", to_addr, ready[1], seconds,
                                        int(max_bytes)],
                            stdout=subprocess.PIPE, text=True)
        return Bulk(sender, receiver, seconds)


# ------------------------------------------------------------------------------ teardown on exit and on signals

_LIVE: set[NetLab] = set()
_PREVIOUS: dict[int, object] = {}
_LOCK = threading.RLock()  # re-entrant: a signal's handler closes labs on the thread that may hold it
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _close_all() -> None:
    for lab in list(_LIVE):
        try:
            lab.close()
        except Exception:  # noqa: BLE001 - one lab failing to go must not keep the others
            pass


def _on_signal(signum, frame) -> None:
    _close_all()
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action, as if no lab had been there
    os.kill(os.getpid(), signum)


@functools.cache
def _register_atexit() -> None:
    atexit.register(_close_all)


def _register(lab: NetLab) -> None:
    _register_atexit()
    with _LOCK:
        _LIVE.add(lab)
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit still covers this lab
        for sig in _SIGNALS:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN or current is _on_signal:
                continue  # an ignored signal stays ignored
            _PREVIOUS[sig] = current
            signal.signal(sig, _on_signal)


def _unregister(lab: NetLab) -> None:
    with _LOCK:
        _LIVE.discard(lab)
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(_PREVIOUS.items()):
            if signal.getsignal(sig) is _on_signal:  # put back what was there, unless someone replaced us since
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            del _PREVIOUS[sig]


# ---------------------------------------------------------------------------------------------- can it be built


@functools.cache
def can_create_lab() -> str | None:
    """None when a lab can be built here; else why not (not root, no ``ip``/``tc``, no network namespaces, veth,
    HTB or u32), found by building a small lab and removing it."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and shape links"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's {tool!r} is not installed"
    try:
        with NetLab(rate="1Mbit"):
            pass
    except LabError as exc:
        return str(exc)
    return None
