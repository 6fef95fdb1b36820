"""Files of every format version still read (spec/FORMAT.md §8): each committed fixture in tests/fixtures/ is
decoded and its tensors compared with the hashes stored here. A change to the bytes is a new version with a new
fixture; the old fixtures and their hashes never change.

``format-1.0.lynx`` (4,995 bytes) was written by the format-1.0 writer, a single file with every segment:

    g = torch.Generator().manual_seed(10)
    kv = [tuple((torch.randn(1, 36, 16, generator=g) * s).to(torch.bfloat16) for s in (3.0, 1.0)) for _ in range(2)]
    save_cache(path, kv, DEFAULT, single_file=True, zstd=True, exact=True, prompt_token_ids=list(range(7, 43)),
               names=["k0", "v0", "k1", "v1"], cache_id=bytes(range(16)),
               properties={"lynxkv.model": "tests/fixtures", "source": "seeded gaussians"})

The default scheme (keys rotated, values per channel, 4 sink tokens, extremes at the range ends), zstd pages, the
exact segment inline; the exact values are the seeded input itself, bit for bit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from lynxkv.cache import open_cache
from lynxkv.format import constants as c
from lynxkv.quant.scheme import DEFAULT

FIXTURES = Path(__file__).resolve().parent / "fixtures"

#: fixture -> (its SHA-256, then that of the decoded tensors: full code, anchor alone, exact), K then V per layer
WANT = {
    "format-1.0.lynx": ("98e1aa3e3eec6e799dc622c30d5e7dec56011c173cf0690c7e577106ae0e6bd8", {
        "full": "814c477ad36f23b1ae14ab61934e065c15f306262f26d6988ef813b065efab41",
        "anchor_only": "0107915054d060d59803d6bed5edd2f2b15efd3b33944aada0cdc1383ad7e32d",
        "exact": "2d230544a68daec1f4cc2c718890174101380c1a4923bcc16433dd32a13d6ab3",
    }),
}


def tensors_hash(layers) -> str:
    h = hashlib.sha256()
    for k, v in layers:
        for t in (k, v):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_every_version_has_a_fixture():
    assert f"format-{c.VERSION_MAJOR}.{c.VERSION_MINOR}.lynx" in WANT
    assert sorted(p.name for p in FIXTURES.glob("*.lynx")) == sorted(WANT)


@pytest.mark.parametrize("name", sorted(WANT))
def test_a_committed_file_still_reads_to_the_same_tensors(name):
    data = (FIXTURES / name).read_bytes()
    file_hash, decoded = WANT[name]
    assert hashlib.sha256(data).hexdigest() == file_hash, f"{name} changed: fixtures are never rewritten"
    with open_cache(data) as cache:
        assert cache.verify() == []
        assert cache.info.format_version == name.removeprefix("format-").removesuffix(".lynx")
        assert cache.info.has_exact and cache.info.scheme == DEFAULT
        assert tensors_hash(cache.load_kv()) == decoded["full"]
        assert tensors_hash(cache.load_kv(anchor_only=True)) == decoded["anchor_only"]
        exact = cache.load_kv(exact=True)
        assert exact[0][0].dtype == torch.bfloat16 and tensors_hash(exact) == decoded["exact"]
