"""The hex examples of spec/FORMAT.md: the writer produces exactly the valid ones and the reader accepts them;
the reader rejects each labelled-invalid one with the field the spec states."""

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
BLOCK = re.compile(r"```hex ([^\n]*)\n(.*?)```", re.S)

# The example cache as spec/FORMAT.md §11 describes it.
SCHEME = Scheme(chunk=2, page=2)
K = torch.tensor([[[0.0, 1.0], [0.5, -1.0], [2.0, 3.0]]])
V = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [-0.25, 0.75]]])


def hex_blocks() -> list[tuple[dict, bytes]]:
    blocks = []
    for info, body in BLOCK.findall(SPEC.read_text(encoding="utf-8")):
        attrs = dict(item.split("=", 1) for item in info.split())
        hexdigits = "".join(line.split(":", 1)[1] for line in body.strip().splitlines())
        blocks.append((attrs, bytes.fromhex(hexdigits)))
    return blocks


def example(name: str) -> bytes:
    return next(data for attrs, data in hex_blocks() if attrs.get("example") == name)


def built():
    enc = encode_kv([(K, V)], SCHEME, prompt_token_ids=[1, 2, 3])
    return build_files(enc, cache_id=bytes(range(16)), residual_location="example.lynxr")


def test_spec_has_the_examples():
    kinds = [attrs.get("example") or attrs.get("invalid") for attrs, _ in hex_blocks()]
    assert kinds.count("anchor") >= 2 and kinds.count("residual") >= 2 and kinds.count("exact") >= 3
    assert zlib.crc32(b"123456789") == 0xCBF43926  # the CRC the spec names


def test_writer_produces_exactly_the_spec_bytes():
    b = built()
    assert b.anchor == example("anchor"), "anchor file differs from spec/FORMAT.md §11"
    assert b.residual == example("residual"), "residual file differs from spec/FORMAT.md §11"


def test_reader_accepts_the_valid_examples(tmp_path):
    (tmp_path / "example.lynx").write_bytes(example("anchor"))
    (tmp_path / "example.lynxr").write_bytes(example("residual"))
    with open_cache(tmp_path / "example.lynx") as cache:
        assert cache.verify() == []
        info = cache.info
        assert (info.layers, info.kv_heads, info.tokens, info.head_dim, info.pages_per_layer) == (1, 1, 3, 2, 2)
        assert info.prompt_token_ids == [1, 2, 3] and info.cache_id == bytes(range(16)).hex()
        assert info.residual_location == "example.lynxr" and info.scheme == SCHEME
        (k, v), = cache.load_kv()
        assert torch.equal(k, dequantize(quantize(K, SCHEME), SCHEME))
        assert torch.equal(v, V)  # constant and one-token chunks decode to their offsets exactly
        (ka, va), = cache.load_kv(anchor_only=True)
        assert torch.equal(ka, K) and torch.equal(va, V)  # the anchor levels hit the chunk extremes here


SCHEME_1_2 = Scheme(chunk=2, page=2, value_axis="channel", sink_tokens=1)


def test_the_1_2_example_is_what_the_writer_writes_and_decodes_its_sink_from_the_full_code():
    enc = encode_kv([(K, V)], SCHEME_1_2, prompt_token_ids=[1, 2, 3])
    data = build_files(enc, cache_id=bytes(range(16)), single_file=True).anchor
    assert data == example("anchor-1.2"), "1.2 anchor file differs from spec/FORMAT.md §11"
    assert data[10] == 2 and data[20] == 1 and data[47] == 1  # version_minor, sink_tokens, value_axis
    with open_cache(data) as cache:
        assert cache.verify() == [] and cache.info.scheme == SCHEME_1_2 and cache.header.version_minor == 2
        (k, v), = cache.load_kv()
        assert torch.equal(k, dequantize(quantize(K, SCHEME_1_2), SCHEME_1_2))
        assert torch.equal(v, dequantize(quantize(V, SCHEME_1_2, "value"), SCHEME_1_2))
        (ka, va), = cache.load_kv(anchor_only=True)
        assert torch.equal(ka[:, :1], k[:, :1])  # the sink token from its full code, from the anchor file alone
        assert torch.equal(ka[:, 1:], K[:, 1:]) and torch.equal(va, V)
        page = cache.read_anchor_page(0, 0)
        assert page.value_offset.shape == (1, 2, 1) and page.key_sinks.tolist() == [[[8, 8]]]
        assert cache.read_anchor_page(0, 1).key_sinks is None


SCHEME_1_3 = Scheme(chunk=2, page=2, key_rotation="hadamard")


def test_the_1_3_example_is_what_the_writer_writes_and_rotates_its_keys_back():
    enc = encode_kv([(K, V)], SCHEME_1_3, prompt_token_ids=[1, 2, 3])
    data = build_files(enc, cache_id=bytes(range(16)), single_file=True).anchor
    assert data == example("anchor-1.3"), "1.3 anchor file differs from spec/FORMAT.md §11"
    assert data[10] == 3 and data[12] == 4  # version_minor, flags: KEY_ROTATION
    rotated = torch.stack([K[..., 0] + K[..., 1], K[..., 0] - K[..., 1]], dim=-1)  # b = 2, k = 0
    with open_cache(data) as cache:
        assert cache.verify() == [] and cache.info.scheme == SCHEME_1_3 and cache.info.format_version == "1.3"
        page = cache.read_anchor_page(0, 0)
        assert page.key_anchor.tolist() == [[[15, 0], [0, 15]]]  # the codes of the rotated rows
        assert page.key_offset.tolist() == [[[0.25, 0.25]]] and page.key_scale.tolist() == [[[0.75, 1.25]]]
        (k, v), = cache.load_kv()
        assert torch.equal(k, dequantize(quantize(K, SCHEME_1_3), SCHEME_1_3)) and torch.equal(v, V)
        y = dequantize(quantize(rotated, SCHEME), SCHEME)  # the rotated rows as a plain scheme decodes them
        assert torch.equal(k, torch.stack([y[..., 0] + y[..., 1], y[..., 0] - y[..., 1]], dim=-1) * 0.5)
        (ka, va), = cache.load_kv(anchor_only=True)
        assert torch.equal(ka, K) and torch.equal(va, V)


def test_minor_3_and_the_flag_only_for_rotated_keys():
    for scheme, minor in ((SCHEME, 0), (SCHEME_1_2, 2), (SCHEME_1_3, 3), (SCHEME_1_2.replace(key_rotation="hadamard"), 3)):
        data = build_files(encode_kv([(K, V)], scheme), cache_id=bytes(16), single_file=True).anchor
        assert (data[10], data[12] & 4) == (minor, 4 if minor == 3 else 0), scheme.describe()


SCHEME_1_6 = Scheme(chunk=2, page=2, extremes="range")


def test_the_1_6_example_is_what_the_writer_writes_and_decodes_the_extremes_exactly(tmp_path):
    enc = encode_kv([(K, V)], SCHEME_1_6, prompt_token_ids=[1, 2, 3])
    b = build_files(enc, cache_id=bytes(range(16)), residual_location="example.lynxr")
    assert b.anchor == example("anchor-1.6"), "1.6 anchor file differs from spec/FORMAT.md §11"
    assert b.residual == example("residual")  # the codes do not depend on where the extremes decode
    first = example("anchor")
    assert [i for i in range(len(first)) if first[i] != b.anchor[i]] == [10, 12, 188, 189, 190, 191]
    assert b.anchor[10] == 6 and b.anchor[12] == 8  # version_minor, flags: EXTREMES
    (tmp_path / "example.lynx").write_bytes(b.anchor)
    (tmp_path / "example.lynxr").write_bytes(b.residual)
    with open_cache(tmp_path / "example.lynx") as cache:
        assert cache.verify() == [] and cache.info.scheme == SCHEME_1_6 and cache.info.format_version == "1.6"
        (k, v), = cache.load_kv()
        assert torch.equal(k, K) and torch.equal(v, V)  # chunk 0's codes (0, 8) and (15, 8): its extremes
        assert float(dequantize(quantize(K, SCHEME), SCHEME)[0, 0, 0]) > 0  # 1.0-1.5: half a sub-bin inside
        (ka, va), = cache.load_kv(anchor_only=True)
        assert torch.equal(ka, K) and torch.equal(va, V)


def test_minor_6_and_the_flag_only_for_extremes_at_the_range():
    for scheme, minor in ((SCHEME, 0), (SCHEME_1_3, 3), (SCHEME_1_6, 6), (SCHEME_1_3.replace(extremes="range"), 6)):
        data = build_files(encode_kv([(K, V)], scheme), cache_id=bytes(16), single_file=True).anchor
        assert (data[10], data[12] & 8) == (minor, 8 if minor == 6 else 0), scheme.describe()
        with open_cache(data) as cache:
            assert cache.info.scheme == scheme


def built_1_4():
    """The 1.4 example: the tensors in bf16 with an exact segment in its own file."""
    kb, vb = K.to(torch.bfloat16), V.to(torch.bfloat16)
    enc = encode_kv([(kb, vb)], SCHEME, prompt_token_ids=[1, 2, 3])
    return (kb, vb), build_files(enc, cache_id=bytes(range(16)), residual_location="example.lynxr",
                                 exact_kv=[(kb, vb)], exact_location="example.lynxe", exact_coding="planes")


def test_the_1_4_example_is_what_the_writer_writes_and_rebuilds_the_bf16_tensors(tmp_path):
    (kb, vb), b = built_1_4()
    assert b.anchor == example("anchor-1.4"), "1.4 anchor file differs from spec/FORMAT.md §11"
    assert b.exact == example("exact"), "exact file differs from spec/FORMAT.md §11"
    assert b.residual == example("residual")  # the codes do not depend on the dtype
    assert b.anchor[10] == 4 and b.anchor[40] == 2 and b.anchor[84] == 3  # version_minor, dtype, segment_count
    assert b.anchor[240:] == example("anchor")[192:]  # the anchor section is the first example's
    exact = example("exact")
    assert exact[132:140] == bytes.fromhex("7500000000000000") and exact[124:132] == bytes.fromhex("1100010100000000")
    for name, data in (("example.lynx", example("anchor-1.4")), ("example.lynxr", example("residual")),
                       ("example.lynxe", exact)):
        (tmp_path / name).write_bytes(data)
    with open_cache(tmp_path / "example.lynx") as cache:
        assert cache.verify() == [] and cache.info.format_version == "1.4" and cache.info.has_exact
        (k, v), = cache.load_kv(exact=True)
        assert k.dtype == torch.bfloat16 and torch.equal(k.view(torch.int16), kb.view(torch.int16))
        assert torch.equal(v.view(torch.int16), vb.view(torch.int16))
        (pk, _), = cache.load_kv()
        assert pk.view(torch.int16).reshape(-1).tolist() == [0x3a89, 0x3f81, 0x3f00, 0xbf7f - 0x10000, 0x4000, 0x4040]


def test_the_1_5_example_is_what_the_writer_writes_in_coding_2_and_rebuilds_the_bf16_tensors(tmp_path):
    kb, vb = K.to(torch.bfloat16), V.to(torch.bfloat16)
    enc = encode_kv([(kb, vb)], SCHEME, prompt_token_ids=[1, 2, 3])
    b = build_files(enc, cache_id=bytes(range(16)), residual_location="example.lynxr", exact_kv=[(kb, vb)],
                    exact_location="example.lynxe")  # coding 2 is the default
    assert b.anchor == example("anchor-1.5"), "1.5 anchor file differs from spec/FORMAT.md §11"
    assert b.exact == example("exact-1.5"), "1.5 exact file differs from spec/FORMAT.md §11"
    old = example("anchor-1.4")
    assert [i for i in range(len(old)) if old[i] != b.anchor[i]] == [10, 176, 184, 185, 186, 187, 236, 237, 238, 239]
    exact = example("exact-1.5")
    assert exact[61] == 2 and exact[120:124] == example("exact")[120:124]  # coding 2; the same original CRC
    assert exact[124:140] == bytes.fromhex("04000000" * 4) and exact[140:143] == bytes.fromhex("268005")
    assert exact[182:198] == bytes.fromhex("80cb0c00" "80660600" "808d0200" "80660600")
    assert exact[198:200] == bytes.fromhex("1115") and exact[220:223] == bytes.fromhex("018008")
    for name, data in (("example.lynx", example("anchor-1.5")), ("example.lynxr", example("residual")),
                       ("example.lynxe", exact)):
        (tmp_path / name).write_bytes(data)
    with open_cache(tmp_path / "example.lynx") as cache:
        assert cache.verify() == [] and cache.info.format_version == "1.5" and cache.info.has_exact
        (k, v), = cache.load_kv(exact=True)
        assert torch.equal(k.view(torch.int16), kb.view(torch.int16)) and torch.equal(v.view(torch.int16),
                                                                                       vb.view(torch.int16))


INVALID = [(attrs, data) for attrs, data in hex_blocks() if "invalid" in attrs]


@pytest.mark.parametrize("attrs,data", INVALID, ids=[f"{a['invalid']}-{a['field']}" for a, _ in INVALID])
def test_reader_rejects_the_invalid_examples(attrs, data):
    with pytest.raises(FormatError) as info:
        if attrs["invalid"] == "anchor":
            with open_cache(data) as cache:
                cache.load_kv()
        elif attrs["invalid"] == "exact":
            with open_cache(example("anchor-1.4"), residual=example("residual"), exact=data) as cache:
                cache.load_kv(exact=True)
        else:
            with open_cache(example("anchor"), residual=data) as cache:
                cache.load_kv()
    assert info.value.field == attrs["field"], str(info.value)
