"""Faults on purpose: what a killed writer or a full disk leaves, and the fault campaign at a small size
(``benchmarks/fault_campaign.py``; docs/faults.md has the full run)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lynxkv.cache import save_cache
from lynxkv.quant.scheme import Scheme

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
