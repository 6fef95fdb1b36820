"""Bad files: one per rule (table-driven), every single-byte corruption and truncation, and a fuzz test."""

from __future__ import annotations

import random
import struct
import zlib

import pytest
import torch

from lynxkv.cache import encode_kv, open_cache
from lynxkv.errors import ChecksumError, FormatError, LynxError
from lynxkv.format import constants as c
from lynxkv.storage import BytesSource
from lynxkv.format.verify import verify_cache
from lynxkv.format.writer import build_files
from lynxkv.quant.scheme import Scheme, get_scheme

SCHEME = Scheme(chunk=4, page=8)
#: Every scheme field of the default: keys rotated (flag KEY_ROTATION), values per channel, 4 sink tokens, and
#: the full code's end sub-bins decoded at the chunk's extremes (flag EXTREMES); and the same at the midpoints.
SCHEME_DEFAULT = get_scheme("default", chunk=4, page=8)
SCHEME_MIDPOINT = SCHEME_DEFAULT.replace(extremes="midpoint")
FINGERPRINT = "00112233445566778899aabbccddeeff"


def small_cache(seed: int = 0, *, zstd: bool = False, single: bool = False, tokens: int = 11, scheme=SCHEME):
    """2 layers x 2 pages (8 + 3 tokens), 1 head, head_dim 2: a few hundred bytes in all."""
    g = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(1, tokens, 2, generator=g), torch.randn(1, tokens, 2, generator=g)) for _ in range(2)]
    enc = encode_kv(kv, scheme, prompt_token_ids=[1, 2, 3], model_fingerprint=FINGERPRINT,
                    names=["k0", "v0", "k1", "v1"])
    return build_files(enc, cache_id=bytes([seed]) * 16, zstd=zstd, single_file=single, residual_location="c.lynxr")


# -- editing helpers: change one field and keep every other check valid ------------------------------------
def u32(b: bytearray, at: int, value: int) -> bytearray:
    struct.pack_into("<I", b, at, value)
    return b


def fix_header_crc(b: bytearray) -> bytearray:
    length = struct.unpack_from("<I", b, 16)[0]
    struct.pack_into("<I", b, length - 4, zlib.crc32(bytes(b[: length - 4])))
    return b


def fix_residual_crc(b: bytearray) -> bytearray:
    struct.pack_into("<I", b, 68, zlib.crc32(bytes(b[:68])))
    return b


def edit_header(field: str, value: int, size: str = "I"):
    def edit(a: bytearray, r: bytearray):
        if field == "header_length":  # the CRC sits at header_length - 4: re-seal where it was
            fix_header_crc(a)
        struct.pack_into("<" + size, a, c.ANCHOR_FIELD_OFFSETS[field], value)
        if field != "header_length":
            fix_header_crc(a)
    return edit


def edit_index(entry: int, delta_offset: int = 0, stored: int | None = None, codec: int | None = None):
    """Change anchor index entry ``entry`` and re-seal the index CRC and the header CRC."""
    def edit(a: bytearray, r: bytearray):
        hl = struct.unpack_from("<I", a, 16)[0]
        at = hl + entry * c.PAGE_ENTRY_SIZE
        struct.pack_into("<Q", a, at, struct.unpack_from("<Q", a, at)[0] + delta_offset)
        if stored is not None:
            u32(a, at + 8, stored)
        if codec is not None:
            a[at + 16] = codec
        n = struct.unpack_from("<I", a, c.ANCHOR_FIXED_SIZE + 4)[0]
        u32(a, c.ANCHOR_FIXED_SIZE + 24, zlib.crc32(bytes(a[hl:hl + n * c.PAGE_ENTRY_SIZE])))
        fix_header_crc(a)
    return edit


def anchor_bytes_edit(fn):
    def edit(a: bytearray, r: bytearray):
        fn(a)
    return edit


def residual_edit(fn):
    def edit(a: bytearray, r: bytearray):
        fn(r)
    return edit


def other_residual(a: bytearray, r: bytearray):
    r[:] = small_cache(seed=1).residual  # same shape, another cache id


def header_padding(a: bytearray, r: bytearray):
    hl = struct.unpack_from("<I", a, 16)[0]
    a[hl - 5] = 1  # the byte before the CRC is padding in this header (checked below)
    fix_header_crc(a)


def bad_fingerprint(a: bytearray, r: bytearray):
    at = bytes(a).index(FINGERPRINT.encode())
    a[at] = ord("G")
    fix_header_crc(a)


def bad_names(a: bytearray, r: bytearray):
    at = bytes(a).index(b"k0\nv0")
    a[at + 2] = ord(",")  # three names for two layers
    fix_header_crc(a)


def segment_offset(a: bytearray, r: bytearray):
    struct.pack_into("<Q", a, c.ANCHOR_FIXED_SIZE + 8, 8)
    fix_header_crc(a)


def residual_count(a: bytearray, r: bytearray):
    u32(r, c.RESIDUAL_FIELD_OFFSETS["tokens"], 12)
    fix_residual_crc(r)


# id, edit, segment of the expected error, expected field, error class
CORPUS = [
    ("anchor-bad-magic", anchor_bytes_edit(lambda a: a.__setitem__(1, ord("l"))), "anchor", "magic", FormatError),
    ("anchor-version-2", edit_header("version_major", 2, "H"), "anchor", "version_major", FormatError),
    ("anchor-unknown-flag", edit_header("flags", 1 << 7), "anchor", "flags", FormatError),
    ("anchor-unknown-value-axis", edit_header("value_axis", 2, "B"), "anchor", "value_axis", FormatError),
    ("anchor-sink-tokens-over-cap", edit_header("sink_tokens", 65537), "anchor", "scheme", FormatError),
    ("anchor-sink-tokens-without-their-records", edit_header("sink_tokens", 1), "anchor", "page.raw_length",
     FormatError),
    ("anchor-values-per-channel-without-their-metadata", edit_header("value_axis", 1, "B"), "anchor",
     "page.raw_length", FormatError),
    ("anchor-unknown-grid", edit_header("grid", 2, "B"), "anchor", "grid", FormatError),
    ("anchor-header-over-cap", edit_header("header_length", c.MAX_ANCHOR_HEADER + 8), "anchor", "header_length",
     FormatError),
    ("anchor-header-past-eof", edit_header("header_length", 1 << 20), "anchor", "header_length", FormatError),
    ("anchor-header-unaligned", edit_header("header_length", 100), "anchor", "header_length", FormatError),
    ("anchor-header-crc", anchor_bytes_edit(lambda a: a.__setitem__(37, a[37] ^ 1)), "anchor", "header_crc32",
     ChecksumError),
    ("anchor-layers-over-cap", edit_header("layers", 0xFFFFFFFF), "anchor", "layers", FormatError),
    ("anchor-tokens-over-cap", edit_header("tokens", c.MAX_TOKENS + 1), "anchor", "tokens", FormatError),
    ("anchor-prompt-over-cap", edit_header("prompt_token_count", 0xFFFFFFFF), "anchor", "prompt_token_count",
     FormatError),
    ("anchor-no-segments", edit_header("segment_count", 0, "H"), "anchor", "segment_count", FormatError),
    ("anchor-counts-exceed-header", edit_header("prompt_token_count", 1000), "anchor", "header_length",
     FormatError),
    ("anchor-unknown-dtype", edit_header("dtype", 9, "B"), "anchor", "dtype", FormatError),
    ("anchor-invalid-scheme", edit_header("chunk", 3), "anchor", "scheme", FormatError),
    ("anchor-tokens-mismatch-pages", edit_header("tokens", 20), "anchor", "segments[0].page_count", FormatError),
    ("anchor-padding-nonzero", header_padding, "anchor", "padding", FormatError),
    ("anchor-fingerprint-not-hex", bad_fingerprint, "anchor", "fingerprint", FormatError),
    ("anchor-names-count", bad_names, "anchor", "names", FormatError),
    ("anchor-segment-offset", segment_offset, "anchor", "segments[0].offset", FormatError),
    ("anchor-index-crc", anchor_bytes_edit(lambda a: a.__setitem__(struct.unpack_from("<I", a, 16)[0] + 9, 7)),
     "anchor", "anchor.index_crc32", ChecksumError),
    ("anchor-page-overlap", edit_index(1, delta_offset=-1), "anchor", "page.offset", FormatError),
    ("anchor-page-out-of-bounds", edit_index(3, stored=10_000), "anchor", "page.stored_length", FormatError),
    ("anchor-page-unknown-codec", edit_index(0, codec=9), "anchor", "page.codec", FormatError),
    ("anchor-page-crc", anchor_bytes_edit(lambda a: a.__setitem__(len(a) - 1, a[-1] ^ 0x10)), "anchor",
     "page.crc32", ChecksumError),
    ("anchor-truncated", anchor_bytes_edit(lambda a: a.__delitem__(slice(-1, None))), "anchor", "file_length",
     FormatError),
    ("anchor-trailing-bytes", anchor_bytes_edit(lambda a: a.extend(b"\0")), "anchor", "file_length", FormatError),
    ("anchor-empty-file", anchor_bytes_edit(lambda a: a.clear()), "anchor", "magic", FormatError),
    ("residual-bad-magic", residual_edit(lambda r: r.__setitem__(5, ord("A"))), "residual", "magic", FormatError),
    ("residual-header-crc", residual_edit(lambda r: r.__setitem__(41, r[41] ^ 4)), "residual", "header_crc32",
     ChecksumError),
    ("residual-unknown-flag", residual_edit(lambda r: fix_residual_crc(u32(r, 12, 1))), "residual", "flags",
     FormatError),
    ("residual-reserved-nonzero", residual_edit(lambda r: fix_residual_crc(u32(r, 20, 1))), "residual",
     "reserved0", FormatError),
    ("residual-counts-differ", residual_count, "residual", "tokens", FormatError),
    ("residual-of-another-cache", other_residual, "residual", "cache_id", FormatError),
    ("residual-index-crc", residual_edit(lambda r: r.__setitem__(c.RESIDUAL_HEADER_SIZE + 20, 0)), "residual",
     "residual.index_crc32", ChecksumError),
    ("residual-page-crc", residual_edit(lambda r: r.__setitem__(len(r) - 2, r[-2] ^ 1)), "residual", "page.crc32",
     ChecksumError),
    ("residual-truncated", residual_edit(lambda r: r.__delitem__(slice(-3, None))), "residual", "file_length",
     FormatError),
    ("residual-trailing-bytes", residual_edit(lambda r: r.extend(b"xyz")), "residual", "file_length",
     FormatError),
]


@pytest.mark.parametrize("edit,segment,field,cls", [c_[1:] for c_ in CORPUS], ids=[c_[0] for c_ in CORPUS])
def test_bad_file_is_rejected_naming_the_field(edit, segment, field, cls):
    built = small_cache()
    a, r = bytearray(built.anchor), bytearray(built.residual)
    if edit is header_padding:
        hl = struct.unpack_from("<I", a, 16)[0]
        assert a[hl - 5] == 0, "this header has no padding byte before its CRC; adjust the fixture"
    edit(a, r)
    with pytest.raises(cls) as info:
        with open_cache(bytes(a), residual=bytes(r)) as cache:
            cache.load_kv()
    assert info.value.field == field, str(info.value)
    assert f"`{field}`" in str(info.value) and "expected" in str(info.value)
    findings = verify_cache(BytesSource(bytes(a)), lambda: BytesSource(bytes(r)))
    assert field in [f.field for f in findings if f.segment == segment], findings
    if field in ("page.crc32",):
        assert all(f.layer is not None and f.page is not None for f in findings)


def test_unused_field_is_ignored_but_reserved_is_not():
    built = small_cache()
    a = bytearray(built.anchor)
    edit_header("properties_length", 0xDEADBEEF)(a, None)  # unused without FLAG_PROPERTIES
    with open_cache(bytes(a), residual=built.residual) as cache:
        assert cache.verify() == []


def test_error_message_names_field_position_expected_and_found():
    a = bytearray(small_cache().anchor)
    edit_header("layers", 0xFFFFFFFF)(a, None)
    with pytest.raises(FormatError, match=r"`layers` at anchor byte 24: expected 1 <= layers <= 4096, got 4294967295"):
        open_cache(bytes(a))


def _check_every_byte(anchor: bytes, residual: bytes | None, target: str):
    """Flip one bit in every byte of ``target`` (a different bit per position), and truncate at every length:
    verify must report each with a field, and page problems with their layer and page."""
    data = anchor if target == "anchor" else residual
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 1 << (i % 8)
        a, r = (bytes(bad), residual) if target == "anchor" else (anchor, bytes(bad))
        findings = verify_cache(BytesSource(a), (lambda r=r: BytesSource(r)) if r is not None else None)
        assert findings, f"{target} byte {i}: corruption not reported"
        assert all(f.field and f.message for f in findings)
        for f in findings:
            if f.field.startswith("page"):
                assert f.layer is not None and f.page is not None, f
    for n in range(len(data)):
        a, r = (data[:n], residual) if target == "anchor" else (anchor, data[:n])
        findings = verify_cache(BytesSource(a), (lambda r=r: BytesSource(r)) if r is not None else None)
        assert findings, f"{target} truncated to {n} bytes: not reported"


@pytest.mark.parametrize("target", ["anchor", "residual"])
@pytest.mark.parametrize("zstd", [False, True], ids=["raw", "zstd"])
def test_every_single_byte_corruption_and_truncation_is_reported(target, zstd):
    built = small_cache(zstd=zstd, tokens=40)  # long enough that zstd actually compresses some pages
    assert verify_cache(BytesSource(built.anchor), lambda: BytesSource(built.residual)) == []
    _check_every_byte(built.anchor, built.residual, target)


@pytest.mark.parametrize("scheme", [SCHEME, SCHEME_MIDPOINT, SCHEME_DEFAULT], ids=["linear", "midpoint", "default"])
def test_every_single_byte_corruption_of_a_single_file_is_reported(scheme):
    built = small_cache(single=True, scheme=scheme)
    assert built.anchor[10] == 0  # version_minor: every writer writes 1.0
    assert verify_cache(BytesSource(built.anchor), lambda: None) == []
    _check_every_byte(built.anchor, None, "anchor")


def test_page_corruption_names_its_layer_and_page():
    built = small_cache()
    with open_cache(built.anchor, residual=built.residual) as cache:
        layer, page = 1, 0
        offset, length = cache.anchor_index.span(layer, page)
    a = bytearray(built.anchor)
    a[offset + length // 2] ^= 0xFF
    findings = verify_cache(BytesSource(bytes(a)), lambda: BytesSource(built.residual))
    assert [(f.segment, f.field, f.layer, f.page) for f in findings] == [("anchor", "page.crc32", 1, 0)]
    with open_cache(bytes(a), residual=built.residual) as cache:
        cache.read_anchor_page(0, 0)  # other pages stay readable
        with pytest.raises(ChecksumError, match="anchor layer 1 page 0"):
            cache.read_anchor_page(1, 0)


def _exercise(a: bytes, r: bytes | None) -> None:
    try:
        with open_cache(a, residual=r) as cache:
            cache.verify()
            cache.load_kv(anchor_only=True)
            cache.load_kv()
    except LynxError:
        pass


@pytest.mark.parametrize("scheme", [SCHEME, SCHEME_MIDPOINT, SCHEME_DEFAULT], ids=["linear", "midpoint", "default"])
def test_fuzz_reader_raises_only_lynx_errors(scheme):
    rng = random.Random(1234)
    built = small_cache(zstd=True, tokens=40, scheme=scheme)
    single = small_cache(single=True, scheme=scheme).anchor
    for _ in range(400):
        kind = rng.randrange(5)
        if kind == 0:  # random bytes, sometimes with a valid magic in front
            n = rng.randrange(0, 400)
            blob = bytes(rng.randrange(256) for _ in range(n))
            if rng.random() < 0.5:
                blob = c.ANCHOR_MAGIC + blob
            _exercise(blob, blob)
        else:
            base = single if kind == 1 else built.anchor
            target = bytearray(base if kind < 4 else built.residual)
            for _ in range(rng.randrange(1, 6)):
                i = rng.randrange(len(target))
                target[i] ^= 1 << rng.randrange(8)
            if rng.random() < 0.3:
                del target[rng.randrange(len(target)):]
            if kind < 4:
                _exercise(bytes(target), None if kind == 1 else built.residual)
            else:
                _exercise(built.anchor, bytes(target))


def test_resealed_header_claiming_huge_counts_allocates_nothing():
    """A header whose CRC is valid but whose counts promise gigabytes is refused before any allocation."""
    import tracemalloc

    a = bytearray(small_cache().anchor)
    edit_header("tokens", c.MAX_TOKENS)(a, None)  # 4 Mi tokens: ~1 GiB of codes claimed
    tracemalloc.start()
    with pytest.raises(FormatError):
        open_cache(bytes(a))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_load_kv_reports_the_first_corrupt_layer_whatever_decodes_in_parallel(threads):
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(2, 40, 8, generator=g), torch.randn(2, 40, 8, generator=g)) for _ in range(6)]
    built = build_files(encode_kv(kv, SCHEME), cache_id=bytes(16), single_file=True)
    anchor = bytearray(built.anchor)
    with open_cache(bytes(anchor)) as cache:
        index = cache._reader.index(c.SEGMENT_ANCHOR)
        for layer in (1, 4):  # a byte of one page in layers 1 and 4
            e = index.entry(layer, 2)
            anchor[index.base + e.offset + e.stored_length // 2] ^= 0x40
    with open_cache(bytes(anchor)) as cache:
        with pytest.raises(ChecksumError, match="layer 1 page 2"):
            cache._reader.dequantize_layers([(torch.empty(2, 40, 8), torch.empty(2, 40, 8)) for _ in range(6)],
                                            threads=threads)
