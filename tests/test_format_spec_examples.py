"""The examples of spec/FORMAT.md §11, read out of the spec itself: the writer produces exactly the bytes of every
valid hex example and the reader accepts them; the reader rejects every row of the invalid-example table with the
field it states."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import pytest
import torch

from lynxkv.cache import encode_kv, open_cache
from lynxkv.errors import FormatError
from lynxkv.format.writer import build_files
from lynxkv.quant import dequantize, quantize
from lynxkv.quant.scheme import Scheme

SPEC = Path(__file__).resolve().parents[1] / "spec" / "FORMAT.md"
TEXT = SPEC.read_text(encoding="utf-8")
BLOCK = re.compile(r"```hex example=(\S+)\n(.*?)```", re.S)

# The example caches as spec/FORMAT.md §11 describes them.
SCHEME = Scheme(chunk=2, page=2)
SCHEME_DEFAULT_FIELDS = Scheme(chunk=2, page=2, value_axis="channel", sink_tokens=1, key_rotation="hadamard",
                               extremes="range")
K = torch.tensor([[[0.0, 1.0], [0.5, -1.0], [2.0, 3.0]]])
V = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [-0.25, 0.75]]])
KB, VB = K.to(torch.bfloat16), V.to(torch.bfloat16)


def dump(body: str) -> bytes:
    """The bytes of a hex dump: lines ``offset: bytes``, the offsets running on from 0 without a gap."""
    out = bytearray()
    for line in body.strip().splitlines():
        offset, data = line.split(":", 1)
        assert int(offset, 16) == len(out), f"spec hex dump: line {offset} does not continue at {len(out):04x}"
        out += bytes.fromhex(data)
    return bytes(out)


def examples() -> dict[str, bytes]:
    return {name: dump(body) for name, body in BLOCK.findall(TEXT)}


def invalid_rows() -> list[tuple[str, str, str]]:
    """(from, bytes replaced, field) of every row of the invalid-example table (§11.1)."""
    section = TEXT[TEXT.index("### 11.1 Invalid examples"):TEXT.index("## Version changes")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| from")]
    return [(src, change, field.strip("`")) for src, change, field, _ in rows]


def patched(base: bytes, change: str) -> bytes:
    """``base`` with the change of an invalid row applied: ``offset: bytes`` replacements, or a cut."""
    cut = re.fullmatch(r"cut to (\d+) bytes", change)
    if cut:
        return base[:int(cut.group(1))]
    out = bytearray(base)
    for offset, data in re.findall(r"`([0-9a-f]{4}): ([0-9a-f ]+)`", change):
        new = bytes.fromhex(data)
        assert out[int(offset, 16):int(offset, 16) + len(new)] != new, f"{change}: changes nothing"
        out[int(offset, 16):int(offset, 16) + len(new)] = new
    return bytes(out)


def built():
    enc = encode_kv([(K, V)], SCHEME, prompt_token_ids=[1, 2, 3])
    return build_files(enc, cache_id=bytes(range(16)), residual_location="example.lynxr")


def built_default_fields() -> bytes:
    enc = encode_kv([(K, V)], SCHEME_DEFAULT_FIELDS, prompt_token_ids=[1, 2, 3])
    return build_files(enc, cache_id=bytes(range(16)), single_file=True).anchor


def built_exact():
    enc = encode_kv([(KB, VB)], SCHEME, prompt_token_ids=[1, 2, 3])
    return build_files(enc, cache_id=bytes(range(16)), residual_location="example.lynxr", exact_kv=[(KB, VB)],
                       exact_location="example.lynxe")


def test_the_spec_has_its_examples_and_names_the_crc():
    assert set(examples()) == {"anchor", "residual", "anchor-rotated", "exact"}
    assert len(invalid_rows()) >= 10
    assert zlib.crc32(b"123456789") == 0xCBF43926  # the CRC the spec names
    assert "Version: **1.0**" in TEXT and len(TEXT.splitlines()) <= 600


def test_the_writer_produces_exactly_the_first_example():
    b = built()
    assert b.anchor == examples()["anchor"], "anchor file differs from spec/FORMAT.md §11"
    assert b.residual == examples()["residual"], "residual file differs from spec/FORMAT.md §11"
    assert b.anchor[8:12] == bytes([1, 0, 0, 0])  # version 1.0


def test_the_reader_accepts_the_first_example(tmp_path):
    (tmp_path / "example.lynx").write_bytes(examples()["anchor"])
    (tmp_path / "example.lynxr").write_bytes(examples()["residual"])
    with open_cache(tmp_path / "example.lynx") as cache:
        assert cache.verify() == []
        info = cache.info
        assert (info.layers, info.kv_heads, info.tokens, info.head_dim, info.pages_per_layer) == (1, 1, 3, 2, 2)
        assert info.prompt_token_ids == [1, 2, 3] and info.cache_id == bytes(range(16)).hex()
        assert info.residual_location == "example.lynxr" and info.scheme == SCHEME
        assert info.format_version == "1.0"
        (k, v), = cache.load_kv()
        assert torch.equal(k, dequantize(quantize(K, SCHEME), SCHEME))
        assert float(k[0, 0, 0]) == pytest.approx(0.0010417, abs=1e-7)  # midpoint: a sub-level centre
        assert torch.equal(v, V)  # constant and one-token chunks decode to their offsets exactly
        (ka, va), = cache.load_kv(anchor_only=True)
        assert torch.equal(ka, K) and torch.equal(va, V)  # the anchor levels hit the chunk extremes here


def test_the_default_fields_example_is_what_the_writer_writes_and_decodes_exactly():
    data = built_default_fields()
    assert data == examples()["anchor-rotated"], "anchor-rotated differs from spec/FORMAT.md §11"
    assert data[12] == 0x0C and data[20] == 1 and data[47] == 1  # flags, sink_tokens, value_axis
    with open_cache(data) as cache:
        assert cache.verify() == [] and cache.info.scheme == SCHEME_DEFAULT_FIELDS
        page = cache.read_anchor_page(0, 0)
        assert page.key_anchor.tolist() == [[[15, 0], [0, 15]]]  # the codes of the rotated rows
        assert page.key_offset.tolist() == [[[0.25, 0.25]]] and page.key_scale.tolist() == [[[0.75, 1.25]]]
        assert page.value_offset.shape == (1, 2, 1) and page.key_sinks.tolist() == [[[8, 8]]]
        assert cache.read_anchor_page(0, 1).key_sinks is None
        (k, v), = cache.load_kv()
        assert torch.equal(k, K) and torch.equal(v, V)  # every chunk decodes at its extremes or its offset
        (ka, va), = cache.load_kv(anchor_only=True)
        assert torch.equal(ka, K) and torch.equal(va, V)


def test_the_exact_example_is_what_the_writer_writes_and_rebuilds_the_bf16_tensors(tmp_path):
    b = built_exact()
    first = examples()["anchor"]
    assert b.exact == examples()["exact"], "exact file differs from spec/FORMAT.md §11"
    assert b.residual == examples()["residual"]  # the codes do not depend on the dtype
    # the anchor file as §11 describes it against the first example
    a = b.anchor
    assert len(a) == 326 and a[40] == 2 and a[84] == 3 and a[240:] == first[192:]
    assert a[160:192] == bytes.fromhex("03010d0002000000" "0000000000000000" "9800000000000000" "4e5bc46000000000")
    assert a[204:236] == b"example.lynxrexample.lynxe" + bytes(6) and a[236:240] == bytes.fromhex("b6cb458d")
    exact = examples()["exact"]
    assert exact[61] == 1 and exact[120:124] == bytes.fromhex("34efd1fa")  # coding 1; the original CRC
    assert exact[124:132] == bytes.fromhex("1100010100000000") and exact[132:140] == bytes.fromhex("7500000000000000")
    for name, data in (("example.lynx", a), ("example.lynxr", b.residual), ("example.lynxe", exact)):
        (tmp_path / name).write_bytes(data)
    with open_cache(tmp_path / "example.lynx") as cache:
        assert cache.verify() == [] and cache.info.has_exact
        (k, v), = cache.load_kv(exact=True)
        assert k.dtype == torch.bfloat16 and torch.equal(k.view(torch.int16), KB.view(torch.int16))
        assert torch.equal(v.view(torch.int16), VB.view(torch.int16))
        (pk, _), = cache.load_kv()
        assert pk.view(torch.int16).reshape(-1).tolist() == [0x3a89, 0x3f81, 0x3f00, 0xbf7f - 0x10000, 0x4000, 0x4040]


INVALID = invalid_rows()


@pytest.mark.parametrize("source,change,field", INVALID, ids=[f"{s}-{f}-{i}" for i, (s, _, f) in enumerate(INVALID)])
def test_the_reader_rejects_every_invalid_example(source, change, field):
    ex = examples()
    exact_anchor = built_exact().anchor  # its bytes are checked against the spec's description above
    with pytest.raises(FormatError) as info:
        if source == "anchor":
            with open_cache(patched(ex["anchor"], change)) as cache:
                cache.load_kv()
        elif source == "residual":
            with open_cache(ex["anchor"], residual=patched(ex["residual"], change)) as cache:
                cache.load_kv()
        else:
            assert source == "exact", source
            with open_cache(exact_anchor, residual=ex["residual"], exact=patched(ex["exact"], change)) as cache:
                cache.load_kv(exact=True)
    assert info.value.field == field, str(info.value)


def test_a_later_minor_version_is_read_as_the_spec_says():
    """§8: a reader of 1.x reads any 1.y (only reserved flag bits and unknown majors are refused)."""
    a = bytearray(examples()["anchor"])
    a[10] = 7  # version_minor 7, the header CRC made valid again
    hl = int.from_bytes(a[16:20], "little")
    a[hl - 4:hl] = zlib.crc32(bytes(a[:hl - 4])).to_bytes(4, "little")
    with open_cache(bytes(a), residual=examples()["residual"]) as cache:
        assert cache.info.format_version == "1.7" and cache.verify() == []
        (k, _), = cache.load_kv()
        assert torch.equal(k, dequantize(quantize(K, SCHEME), SCHEME))
