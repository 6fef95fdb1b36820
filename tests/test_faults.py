"""Faults on purpose: what a killed writer or a full disk leaves, and the fault campaign at a small size
(``benchmarks/fault_campaign.py``; docs/faults.md has the full run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lynxkv.cache import open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import InputError
from lynxkv.quant.scheme import Scheme

ROOT = Path(__file__).resolve().parents[1]
SCHEME = Scheme(chunk=4, page=8)


def kv(seed: int = 0, tokens: int = 20):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 4, generator=g), torch.randn(2, tokens, 4, generator=g)) for _ in range(2)]


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_temporaries_of_a_killed_replacement_under_a_fresh_residual_name_are_cleaned(tmp_path):
    # A replacement writes its residual under a fresh name (c.<8 hex>.lynxr), so a killed one leaves a temporary
    # named after that fresh name; the next writer of c.lynx uses another fresh name and must still remove it.
    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    dead = tmp_path / ".c.0badcafe.lynxr.999999999-0badcafe.tmp"  # its writer is gone
    live = tmp_path / f".c.0badcafe.lynxr.{os.getpid()}-0badcafe.tmp"  # a writer still at work
    other = tmp_path / ".d.0badcafe.lynxr.999999999-0badcafe.tmp"  # another cache's business
    for p in (dead, live, other):
        p.write_bytes(b"half")
    save_cache(tmp_path / "c.lynx", kv(2), SCHEME)
    assert not dead.exists() and live.exists() and other.exists()


def test_tier_on_a_full_disk_removes_the_residual_copy_no_anchor_names(tmp_path, monkeypatch, capsys):
    import lynxkv.stream.tier as tier

    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    before = {n: (tmp_path / n).read_bytes() for n in names(tmp_path)}
    real = tier.write_atomic

    def full_for_anchors(url, data, **kw):
        if str(url).endswith(".lynx"):
            raise InputError(f"{url}: no space left on the device; nothing was written")
        return real(url, data, **kw)

    monkeypatch.setattr(tier, "write_atomic", full_for_anchors)
    code = main(["tier", str(tmp_path / "c.lynx"), "--residual-out", str(tmp_path / "far" / "c.lynxr")])
    assert code == 1 and "no space left" in capsys.readouterr().err
    assert names(tmp_path / "far") == []  # the copy that was published first is gone again
    assert {n: (tmp_path / n).read_bytes() for n in names(tmp_path) if n != "far"} == before
    assert verify_file(tmp_path / "c.lynx") == []


def test_stream_copy_on_a_full_disk_leaves_no_residual_behind(tmp_path, monkeypatch, capsys):
    from lynxkv.storage import AtomicWriter

    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    real, calls = AtomicWriter.commit, []

    def commit(self):
        calls.append(self.url)
        if len(calls) == 2:  # the anchor, after the residual was published
            self.abort()
            raise InputError(f"{self.url}: no space left on the device; nothing was written")
        return real(self)

    monkeypatch.setattr(AtomicWriter, "commit", commit)
    code = main(["stream", str(tmp_path / "c.lynx"), "-o", str(tmp_path / "dl" / "c.lynx")])
    assert code == 1 and "no space left" in capsys.readouterr().err
    assert calls[0].endswith(".lynxr") and names(tmp_path / "dl") == []


@pytest.mark.slow
def test_fault_campaign_small(tmp_path):
    """40 random SIGKILLs across encode, tier, stream -o and the LMCache tier's store, and 8 full disks: every
    cache path old or new and whole, nothing left after the next writer."""
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, "benchmarks/fault_campaign.py", "--kills", "40", "--full-disk", "8",
                           "--json", str(out), "--tmp", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["failures"] == [] and proc.returncode == 0, proc.stdout[-3000:]
    assert got["kills"] == 40 and got["landed"] > 10  # most kills land while the command runs
    assert got["lost"] == 0 and got["mixed"] == 0 and got["leftovers_after_next_writer"] == 0
    assert got["states"]["old"] > 0 and got["states"]["new"] > 0
    assert got["full_disk"]["events"] == 8 and got["full_disk"]["failed_cleanly"] > 0
    assert got["full_disk"]["other_rc"] == 0
