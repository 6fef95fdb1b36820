"""The lab link's shaping: the ``tc`` commands of an HTB tree that sends each packet to a class by its DSCP mark.

The tree, on one interface's egress::

    1:    htb qdisc, unclassified packets go to the default class
    1:1   root class: rate = ceil = the link's rate (the link itself)
    1:10, 1:20, ...  one child per traffic class: a small assured rate (1 % of the link), ceil = the link's rate,
          ``prio`` 0..7 and one common quantum

A child gets its assured rate whatever happens; the rest of the link is lent to the children that want it, the
lowest ``prio`` number first, and children of equal ``prio`` share it equally (equal quanta). ``u32 match ip
dsfield`` filters steer a packet to its class by its DSCP (the TOS byte's top six bits, mask 0xfc); a packet no
filter matches (unmarked, or a mark no class names) goes to the default class. IPv4 only: the lab's addresses are.

The default classes follow the marks ``lynxkv serve --dscp-anchor EF --dscp-residual CS1`` sets (the exact segment
takes the residual's unless ``--dscp-exact`` says otherwise): the anchor first, then the residual, with unmarked
traffic (competing bulk transfers) at the residual's priority, so the two share what the anchor leaves. This kernel
has ``htb``, ``tbf`` and ``u32`` but no ``netem``, ``prio`` or ``fq_codel``, hence HTB priorities.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lynxkv.serve.resources import DSCP
from lynxkv.stream.units import parse_bandwidth

#: Bytes a class may send per round when the spare rate is shared: the same for every class, so classes of equal
#: ``prio`` share equally; as large as a GSO packet on a veth (64 KiB) would be wasteful, one MTU would make HTB
#: warn, so a few MTUs.
QUANTUM = 4 * 1514
MIN_RATE_BITS = 100_000  # below this the assured rates (1 % each, at least 8 kbit/s) would not fit in the link
ASSURED_SHARE = 0.01


@dataclass(frozen=True)
class TrafficClass:
    """One child class: ``name`` for people, ``prio`` 0..7 (0 borrows first), the DSCP code points it takes
    (``()`` marks the default class, which also takes unmarked packets)."""

    name: str
    prio: int
    dscp: tuple[int, ...] = ()


LYNX_CLASSES = (
    TrafficClass("anchor", 0, (DSCP["EF"],)),
    TrafficClass("residual", 1, (DSCP["CS1"],)),
    TrafficClass("bulk", 1, ()),
)


def parse_rate(rate: str | int | float) -> int:
    """A link rate in bits/s: ``"60Mbit"`` (tc's spelling), ``"60Mbps"``, ``"7.5MB/s"``; a number is bits/s."""
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        text = rate.strip()
        bits = parse_bandwidth(text + "/s" if text.endswith("bit") else text) * 8
    if not bits >= MIN_RATE_BITS:
        raise ValueError(f"link rate {rate!r}: at least {MIN_RATE_BITS} bit/s")
    return int(bits)


def check_classes(classes: tuple[TrafficClass, ...]) -> None:
    """One default class, ``prio`` within 0..7, DSCP within 0..63, no code point in two classes."""
    defaults = [c.name for c in classes if not c.dscp]
    if len(defaults) != 1:
        raise ValueError(f"traffic classes: expected exactly one default class (no DSCP), got {defaults}")
    seen: dict[int, str] = {}
    for c in classes:
        if not 0 <= c.prio <= 7:
            raise ValueError(f"traffic class {c.name!r}: prio {c.prio} is not within 0..7")
        for d in c.dscp:
            if not 0 <= d <= 63:
                raise ValueError(f"traffic class {c.name!r}: DSCP {d} is not within 0..63")
            if d in seen:
                raise ValueError(f"DSCP {d} is in two traffic classes: {seen[d]!r} and {c.name!r}")
            seen[d] = c.name
    if len(classes) > 9:
        raise ValueError("at most 9 traffic classes")


def class_id(classes: tuple[TrafficClass, ...], name: str) -> str:
    """The HTB class id of the class called ``name`` (``1:10`` for the first, ``1:20`` for the second, ...)."""
    for i, c in enumerate(classes):
        if c.name == name:
            return f"1:{10 * (i + 1)}"
    raise KeyError(name)


def htb_commands(ns: str, dev: str, rate_bits: int, classes: tuple[TrafficClass, ...], *,
                 change: bool = False) -> list[list[str]]:
    """The ``tc`` commands that build the tree on ``dev`` in namespace ``ns`` or, with ``change``, set a new rate on
    the classes of a tree already built (the qdisc and the filters stay)."""
    check_classes(classes)
    tc, verb = ["tc", "-n", ns], "change" if change else "add"
    rate = f"{rate_bits}bit"
    assured = f"{max(int(rate_bits * ASSURED_SHARE), 8000)}bit"
    default = next(class_id(classes, c.name) for c in classes if not c.dscp)
    cmds = []
    if not change:
        cmds.append([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", default[2:]])
    cmds.append([*tc, "class", verb, "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
                 "ceil", rate])
    for c in classes:
        cmds.append([*tc, "class", verb, "dev", dev, "parent", "1:1", "classid", class_id(classes, c.name), "htb",
                     "rate", assured, "ceil", rate, "prio", str(c.prio), "quantum", str(QUANTUM)])
    if not change:
        for c in classes:
            for d in c.dscp:
                cmds.append([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                             "match", "ip", "dsfield", f"0x{d << 2:02x}", "0xfc", "flowid",
                             class_id(classes, c.name)])
    return cmds


_CLASS_SENT = re.compile(r"^class htb (\d+:\d+) .*?\n\s*Sent (\d+) bytes", re.MULTILINE)


def parse_class_bytes(text: str, classes: tuple[TrafficClass, ...]) -> dict[str, int]:
    """Bytes each class has sent, from ``tc -s class show``: ``{"link": root, <class name>: ...}``."""
    names = {"1:1": "link", **{class_id(classes, c.name): c.name for c in classes}}
    return {names[cid]: int(n) for cid, n in _CLASS_SENT.findall(text) if cid in names}
