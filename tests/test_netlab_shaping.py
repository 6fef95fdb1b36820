"""The lab's shaping table without a lab (no root needed): rates as tc and lynxkv write them, the class table's
rules, and tc commands that steer the marks ``lynxkv serve`` sets to their classes."""

from __future__ import annotations

import pytest

from lynxkv.bench.shaping import LYNX_CLASSES, TrafficClass, htb_commands, parse_class_bytes, parse_rate
from lynxkv.errors import InputError
from lynxkv.serve import parse_dscp


@pytest.mark.parametrize("text, bits", [("60Mbit", 60_000_000), ("60Mbps", 60_000_000), ("7.5MB/s", 60_000_000),
                                        ("1Gbit", 1_000_000_000), (250_000, 250_000)])
def test_rates_read_as_tc_and_lynxkv_write_them(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text, error", [("10kbit", ValueError), (99_999, ValueError), ("fast", InputError)])
def test_a_rate_too_small_or_unreadable_is_refused(text, error):
    with pytest.raises(error, match="rate|bandwidth"):
        parse_rate(text)


def _filters(cmds: list[list[str]]) -> dict[int, str]:
    """TOS byte -> class id, from the u32 filters among ``cmds``."""
    return {int(c[c.index("dsfield") + 1], 16): c[c.index("flowid") + 1] for c in cmds if "filter" in c}


def _prio(cmds: list[list[str]], classid: str) -> int:
    c = next(c for c in cmds if "class" in c and c[c.index("classid") + 1] == classid)
    return int(c[c.index("prio") + 1])


def test_the_marks_lynxkv_serve_sets_reach_their_classes_anchor_first():
    cmds = htb_commands("ns", "lab0", 60_000_000, LYNX_CLASSES)
    steer = _filters(cmds)
    anchor = steer[parse_dscp("EF") << 2]  # lynxkv serve --dscp-anchor EF --dscp-residual CS1
    residual = steer[parse_dscp("CS1") << 2]
    default = next(c for c in cmds if "qdisc" in c)[-1]  # htb default <minor>: unmarked packets
    assert anchor != residual and f"1:{default}" not in (anchor, residual)
    assert _prio(cmds, anchor) < _prio(cmds, residual) == _prio(cmds, f"1:{default}")
    assert all(c[c.index("dsfield") + 2] == "0xfc" for c in cmds if "filter" in c)  # DSCP bits only, not ECN


def test_a_rate_change_touches_the_classes_only():
    cmds = htb_commands("ns", "lab0", 20_000_000, LYNX_CLASSES, change=True)
    assert all(c[3:5] == ["class", "change"] for c in cmds)
    assert all("20000000bit" in c for c in cmds)


@pytest.mark.parametrize("classes, match", [
    ((TrafficClass("a", 0, (46,)),), "one default class"),
    ((TrafficClass("a", 0), TrafficClass("b", 1)), "one default class"),
    ((TrafficClass("a", 8, (46,)), TrafficClass("b", 1)), "prio 8"),
    ((TrafficClass("a", 0, (64,)), TrafficClass("b", 1)), "DSCP 64"),
    ((TrafficClass("a", 0, (46,)), TrafficClass("c", 0, (46,)), TrafficClass("b", 1)), "two traffic classes"),
], ids=["no-default", "two-defaults", "prio", "dscp-range", "dscp-twice"])
def test_a_bad_class_table_is_refused(classes, match):
    with pytest.raises(ValueError, match=match):
        htb_commands("ns", "lab0", 60_000_000, classes)


def test_class_counters_are_read_by_name():
    text = ("class htb 1:1 root rate 20Mbit ceil 20Mbit burst 1600b cburst 1600b \n"
            " Sent 2193276 bytes 1456 pkt (dropped 0, overlimits 55 requeues 0) \n"
            "class htb 1:10 parent 1:1 prio 0 rate 200Kbit ceil 20Mbit burst 1600b cburst 1600b \n"
            " Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0) \n"
            "class htb 1:30 parent 1:1 prio 1 rate 200Kbit ceil 20Mbit burst 1600b cburst 1600b \n"
            " Sent 2193276 bytes 1456 pkt (dropped 0, overlimits 56 requeues 0) \n")
    assert parse_class_bytes(text, LYNX_CLASSES) == {"link": 2193276, "anchor": 0, "bulk": 2193276}
