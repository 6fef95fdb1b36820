"""The exact segment: the original tensors bit for bit, through the API and the CLI; files without it
unchanged; another cache's or a corrupt exact segment refused before any tensor is returned."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lynxkv.cache import encode_kv, open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import ChecksumError, FormatError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.exact_records import apply_exact_record, encode_exact_layer
from lynxkv.format.writer import build_files
from lynxkv.quant import dequantize, quantize
from lynxkv.quant import remainder
from lynxkv.quant.remainder import apply_planes, reference_apply, reference_planes, remainder_planes
from lynxkv.quant.scheme import DEFAULT, PRESETS

from exact_helpers import DTYPES, bits, exact_kv, same_bits


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_remainder_planes_round_trip_every_special_value(dtype):
    dt = DTYPES[dtype]
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 3.0e38, -3.0e38, 6e4, 1e-7, -1e-7]).to(dt)
    p = torch.tensor([-0.0, 0.0, -1.0, 1.0, 0.0, 0.0, -3.0e38, 3.0e38, -6e4, 0.0, 1e-7]).to(dt)  # far and sign-flipped
    assert torch.equal(bits(apply_planes(remainder_planes(x, p), p)), bits(x))
    assert torch.equal(bits(reference_apply(reference_planes(x, p), p)), bits(x))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_remainder_gives_the_reference_bytes(dtype):
    """The compiled planes (lynxkv/quant/_remainder.c) are the torch reference's, byte for byte, in the order of
    the prediction's exponent; each path applies the other's planes."""
    if not remainder.compiled():
        pytest.skip("the compiled remainder is not built")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(50_001, generator=g) * torch.exp(3 * torch.randn(50_001, generator=g))).to(DTYPES[dtype])
    p = (x.float() * (1 + 0.01 * torch.randn(50_001, generator=g))).to(DTYPES[dtype])
    x[:7] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-40]).to(x.dtype)
    p[7:12] = -p[7:12]
    planes, runs = remainder.remainder_planes_and_runs(x, p)
    assert torch.equal(planes, reference_planes(x, p)) and runs == remainder.group_sizes(p)
    assert torch.equal(bits(apply_planes(reference_planes(x, p), p)), bits(x))
    assert torch.equal(bits(reference_apply(planes, p)), bits(x))
    shift, mask = {"bf16": (7, 0xFF), "fp16": (10, 0x1F), "fp32": (23, 0xFF)}[dtype]
    keys = (bits(p).to(torch.int64) >> shift) & mask
    order = torch.argsort(keys, stable=True)
    assert torch.equal(order, remainder.element_order(p)) and not torch.equal(order, torch.arange(len(p)))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("single_file", [False, True], ids=["two-files", "single-file"])
def test_save_open_exact_is_bit_identical(tmp_path, dtype, single_file):
    kv = exact_kv(DTYPES[dtype])
    info = save_cache(tmp_path / "c.lynx", kv, exact=True, single_file=single_file)
    assert info.has_exact and info.format_version == "1.0" and info.exact_inline == single_file
    assert (tmp_path / "c.lynxe").exists() != single_file
    with open_cache(tmp_path / "c.lynx") as cache:
        full = cache.load_kv()
        exact = cache.load_kv(exact=True)
    assert not same_bits(full, kv)  # the full code alone is not exact here: the segment does the work
    assert same_bits(exact, kv)
    assert verify_file(tmp_path / "c.lynx") == []


@pytest.mark.parametrize("scheme", ["default", "linear", "paper", "linear-range", "default-midpoint"])
def test_exact_with_every_preset_and_a_short_last_page(tmp_path, scheme):
    """Every preset, and the full code's end sub-bins decoded either way (the scheme's ``extremes``): the remainder
    is taken against the decoding the file's scheme gives."""
    kv = exact_kv(torch.bfloat16, t=257, d=96)  # rotated keys with b = 32, a page of 1 token at the end
    name, _, extremes = scheme.partition("-")
    save_cache(tmp_path / "c.lynx", kv, PRESETS[name].replace(extremes=extremes or PRESETS[name].extremes),
               exact=True)
    with open_cache(tmp_path / "c.lynx") as cache:
        assert same_bits(cache.load_kv(exact=True), kv)


def _exact_named(path):
    """The exact file the anchor at ``path`` names, which must exist."""
    with open_cache(path) as cache:
        loc = cache.info.exact_location
    assert loc is not None and (path.parent / loc).is_file(), loc
    return loc


def test_replacing_a_cache_gives_the_exact_file_a_fresh_name(tmp_path):
    """Each replacement writes the new exact file under a fresh name before the anchor, and removes the old one
    after: the directory holds one anchor and the two side files it names, and what it names is the new cache."""
    path = tmp_path / "c.lynx"
    save_cache(path, exact_kv(torch.bfloat16, layers=1, t=40, seed=1), exact=True)
    assert _exact_named(path) == "c.lynxe"
    for seed in (2, 3):
        kv = exact_kv(torch.bfloat16, layers=1, t=40, seed=seed)
        save_cache(path, kv, exact=True)
        with open_cache(path) as cache:
            names = sorted(p.name for p in tmp_path.iterdir())
            assert names == sorted(["c.lynx", cache.info.residual_location, cache.info.exact_location]), names
            assert (cache.info.exact_location == "c.lynxe") == (seed == 3)  # a fresh name while c.lynxe is taken
            assert same_bits(cache.load_kv(exact=True), kv)
    save_cache(path, exact_kv(torch.bfloat16, layers=1, t=40, seed=4))  # no exact segment: the old one goes
    assert not any(p.name.endswith(".lynxe") for p in tmp_path.iterdir())
    save_cache(path, exact_kv(torch.bfloat16, layers=1, t=40, seed=5), exact=True, single_file=True)
    assert [p.name for p in tmp_path.iterdir()] == ["c.lynx"]


@pytest.mark.parametrize("fail_at", [1, 2, 3], ids=["residual", "exact", "anchor"])
def test_a_crash_while_replacing_never_leaves_an_anchor_naming_a_missing_or_old_exact_file(tmp_path, monkeypatch,
                                                                                         fail_at):
    """A crash as the n-th file would be published (residual, exact, anchor): the anchor in place is the old one
    and its exact file is its own, whole; the next save cleans up."""
    from lynxkv.storage import AtomicWriter

    path = tmp_path / "c.lynx"
    old = exact_kv(torch.float16, layers=1, t=40, seed=1)
    save_cache(path, old, exact=True)
    real, calls = AtomicWriter.commit, []

    def commit(self):
        calls.append(self.url)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(AtomicWriter, "commit", commit)
    with pytest.raises(KeyboardInterrupt):
        save_cache(path, exact_kv(torch.float16, layers=1, t=40, seed=2), exact=True)
    monkeypatch.undo()
    assert _exact_named(path) == "c.lynxe" and verify_file(path) == []
    with open_cache(path) as cache:
        assert same_bits(cache.load_kv(exact=True), old)
    new = exact_kv(torch.float16, layers=1, t=40, seed=3)
    save_cache(path, new, exact=True)
    with open_cache(path) as cache:
        assert same_bits(cache.load_kv(exact=True), new)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["c.lynx", cache.info.residual_location, cache.info.exact_location])


def test_exact_segment_of_another_cache_is_refused(tmp_path):
    kv = exact_kv(torch.bfloat16)
    save_cache(tmp_path / "a.lynx", kv, exact=True)
    save_cache(tmp_path / "b.lynx", kv, exact=True)  # the same tensors, another cache id
    shutil.copy(tmp_path / "b.lynxe", tmp_path / "a.lynxe")
    with open_cache(tmp_path / "a.lynx") as cache:
        with pytest.raises(FormatError, match="belongs to another cache") as exc:
            cache.load_kv(exact=True)
        assert exc.value.field == "cache_id"
        assert same_bits(cache.load_kv(), cache.load_kv())  # the full code still reads
    assert [f.field for f in verify_file(tmp_path / "a.lynx")] == ["cache_id"]


def test_corrupt_exact_page_is_refused_before_any_tensor(tmp_path):
    save_cache(tmp_path / "c.lynx", exact_kv(torch.float16), exact=True)
    data = bytearray((tmp_path / "c.lynxe").read_bytes())
    data[-1] ^= 0x40  # the last page's bytes
    (tmp_path / "c.lynxe").write_bytes(bytes(data))
    with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(ChecksumError, match="exact layer 2 page 1"):
        cache.load_kv(exact=True)
    found = verify_file(tmp_path / "c.lynx")
    assert [(f.segment, f.field, f.layer, f.page) for f in found] == [("exact", "page.crc32", 2, 1)]


def _exact_codecs(path) -> set[int]:
    with open_cache(path) as cache:
        cache.load_kv(exact=True)
        return {e.codec for e in cache._exact().entries}


def test_exact_pages_are_zstd_frames_split_at_the_exponent_runs(tmp_path):
    """Codec 2: each exact page is several zstd frames (plane 0 split where the prediction's exponent changes),
    smaller than one frame of the same record."""
    import zstandard

    from lynxkv.format.exact_records import frame_splits
    from lynxkv.quant.remainder import group_sizes

    kv = exact_kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    assert _exact_codecs(tmp_path / "c.lynx") == {c.CODEC_ZSTD_FRAMES}
    with open_cache(tmp_path / "c.lynx") as cache:
        (pk, pv), = cache.load_kv()
        entry = cache._exact().entries[0]
    (k, v), = kv
    record, splits = next(encode_exact_layer((k, v), (pk, pv), DEFAULT.page, k.shape[1]))
    pred = torch.cat((pk[:, :256], pv[:, :256])).reshape(-1)
    assert splits == frame_splits(group_sizes(pred), pred.numel(), 2) and len(splits) > 2
    assert entry.stored_length < len(zstandard.ZstdCompressor(level=1).compress(record))


def test_codec_2_outside_the_exact_segment_and_a_frames_bomb_are_refused(tmp_path, monkeypatch, capsys):
    import zstandard

    import lynxkv.format.records as records
    import lynxkv.format.writer as writer

    with monkeypatch.context() as m:  # a writer that stores anchor and residual pages as zstd frames too
        m.setattr(writer, "choose_codec", lambda raw, zstd, level=3, splits=None: (
            c.CODEC_ZSTD_FRAMES, records.compress_frames(raw, [len(raw) // 2], level)))
        data = build_files(encode_kv(exact_kv(torch.bfloat16, layers=1)), zstd=True, single_file=True).anchor
    with pytest.raises(FormatError, match="codec 2 is for exact pages only") as exc:
        with open_cache(data) as cache:
            cache.load_kv()
    assert exc.value.field == "page.codec"
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=False)
    with monkeypatch.context() as m:  # every exact page two frames that inflate to 64x the record
        m.setattr(records, "compress_frames", lambda raw, splits, level: bomb.compress(bytes(32 * len(raw))) * 2)
        save_cache(tmp_path / "b.lynx", exact_kv(torch.bfloat16, layers=1), exact=True)
    with open_cache(tmp_path / "b.lynx") as cache, pytest.raises(FormatError, match="inflates past") as exc:
        cache.load_kv(exact=True)
    assert exc.value.field == "page.raw_length"
    assert main(["decode", str(tmp_path / "b.lynx"), "-o", str(tmp_path / "b.safetensors"), "--exact"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("lynxkv: error:") and "inflates past" in err[0]
    assert not (tmp_path / "b.safetensors").exists()


def test_a_record_that_does_not_rebuild_the_original_is_refused():
    """A record whose page CRC is intact but whose remainder is wrong (or a reader whose prediction differs, or
    whose stored CRC of the original is wrong) fails the check against the CRC of the original bytes."""
    (k, v), = exact_kv(torch.bfloat16, layers=1)
    pred = tuple(dequantize(quantize(t, DEFAULT, kind), DEFAULT, dtype=t.dtype) for t, kind in ((k, "key"), (v, "value")))
    raw = bytearray(next(encode_exact_layer((k, v), pred, DEFAULT.page, k.shape[1]))[0])
    ok_k, ok_v = torch.empty_like(pred[0][:, :256]), torch.empty_like(pred[1][:, :256])
    apply_exact_record(bytes(raw), pred[0][:, :256], pred[1][:, :256], "exact layer 0 page 0", ok_k, ok_v)
    assert torch.equal(bits(ok_k), bits(k[:, :256]))
    raw[c.EXACT_RECORD_CRC_SIZE + 10] ^= 1
    with pytest.raises(ChecksumError, match="does not rebuild") as exc:
        apply_exact_record(bytes(raw), pred[0][:, :256], pred[1][:, :256], "exact layer 0 page 0", ok_k, ok_v)
    assert exc.value.field == "exact.original_crc32"


def test_exact_header_is_bound_by_its_crc_and_reserved_fields(tmp_path):
    save_cache(tmp_path / "c.lynx", exact_kv(torch.bfloat16, layers=1), exact=True)
    good = (tmp_path / "c.lynxe").read_bytes()
    for at, field in ((61, "header_crc32"), (0, "magic"), (8, "version_major")):
        bad = bytearray(good)
        bad[at] ^= 0x02
        (tmp_path / "c.lynxe").write_bytes(bytes(bad))
        with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(FormatError) as exc:
            cache.load_kv(exact=True)
        assert exc.value.field == field
    bad = bytearray(good)
    bad[61] = 9  # coding 9, with a valid header CRC
    import zlib
    bad[68:72] = struct.pack("<I", zlib.crc32(bytes(bad[:68])))
    (tmp_path / "c.lynxe").write_bytes(bytes(bad))
    with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(FormatError) as exc:
        cache.load_kv(exact=True)
    assert exc.value.field == "coding"


def test_no_exact_segment_and_exact_with_anchor_only_are_refused(tmp_path):
    save_cache(tmp_path / "c.lynx", exact_kv(torch.bfloat16, layers=1))
    with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(LynxError, match="no exact segment"):
        cache.load_kv(exact=True)
    save_cache(tmp_path / "e.lynx", exact_kv(torch.bfloat16, layers=1), exact=True)
    with open_cache(tmp_path / "e.lynx") as cache, pytest.raises(LynxError, match="anchor_only"):
        cache.load_kv(exact=True, anchor_only=True)


# -- the command line -------------------------------------------------------------------------------------------
def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cli_encode_exact_decode_exact_is_bit_identical(tmp_path, capsys, dtype):
    tensors = {}
    for i, (k, v) in enumerate(exact_kv(DTYPES[dtype])):
        tensors[f"layers.{i}.key"], tensors[f"layers.{i}.value"] = k, v
    save_file(tensors, tmp_path / "kv.safetensors")
    (tmp_path / "cold").mkdir()  # another tier: the exact file needs not sit beside the anchor
    code, _, err = run(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "c.lynx",
                       "--exact-out", tmp_path / "cold" / "c.lynxe")
    assert code == 0 and "exact" in err
    assert (tmp_path / "cold" / "c.lynxe").exists()
    args = ("--exact-file", tmp_path / "cold" / "c.lynxe")
    assert run(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "back.safetensors", "--exact", *args)[0] == 0
    assert run(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "full.safetensors")[0] == 0
    with safe_open(tmp_path / "back.safetensors", "pt") as f, safe_open(tmp_path / "full.safetensors", "pt") as g:
        assert f.metadata()["lynxkv.reconstruction"] == "exact"
        for name, t in tensors.items():
            assert f.get_tensor(name).dtype == t.dtype and torch.equal(bits(f.get_tensor(name)), bits(t))
        assert not all(torch.equal(bits(g.get_tensor(n)), bits(t)) for n, t in tensors.items())
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx", "--json", "--check-residual")
    d = json.loads(out)
    assert code == 0 and d["has_exact"] and d["format_version"] == "1.0" and d["exact_bytes"] > 0
    assert run(capsys, "verify", tmp_path / "c.lynx", *args)[0] == 0


def test_cli_refuses_a_wrong_exact_segment_with_one_line(tmp_path, capsys):
    kv = exact_kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "a.lynx", kv, exact=True)
    save_cache(tmp_path / "b.lynx", kv, exact=True)
    code, out, err = run(capsys, "decode", tmp_path / "a.lynx", "-o", tmp_path / "x.safetensors",
                         "--exact-file", tmp_path / "b.lynxe")
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lynxkv: error:") and "another cache" in lines[0]
    assert not (tmp_path / "x.safetensors").exists()
    code, _, err = run(capsys, "verify", tmp_path / "a.lynx", "--exact-file", tmp_path / "b.lynxe")
    assert code == 1 and "FAIL exact: `cache_id`" in err
    code, out, _ = run(capsys, "inspect", tmp_path / "a.lynx")
    assert code == 0 and "exact" in out


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_writers_prediction_from_its_records_is_the_full_code_decoded(dtype, name):
    """The writer predicts each layer from the page records it has just written (the reader's decoding): the
    same bits as the quantizer's own full-code decoding, sink tokens and a short last page included, and a
    5-bit split that the packed path does not take."""
    from lynxkv.cache.encoded import lazy_encoding
    from lynxkv.format.exact_records import predict_layer
    from lynxkv.format.records import encode_layer_records

    schemes = [PRESETS[name], PRESETS[name].replace(anchor_bits=3, residual_bits=5)]
    for scheme in schemes:
        kv = exact_kv(DTYPES[dtype], layers=1, t=300)
        for packed in (True, False):
            k, v = lazy_encoding(kv, scheme, None, None, None, packed=packed).layers[0]
            records = [(bytes(a), bytes(r)) for a, r in encode_layer_records(k, v, scheme, 300)]
            got = predict_layer(records, scheme, 2, 64, 300, DTYPES[dtype])
            want = [dequantize(t, scheme, dtype=DTYPES[dtype]) for t in (k, v)]
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_page_is_joined_k_then_v_and_written_back_into_strided_views(dtype):
    """The exact path's page copies (numpy's, on the calling thread): K then V of strided token slices, bit for
    bit (NaN payloads and -0.0 too), and a rebuilt page written back into the slices it came from."""
    from lynxkv.format.exact_records import _ints, joined

    k, v = exact_kv(DTYPES[dtype], layers=1, h=3, t=40, d=8)[0]
    k[0, 10, :2] = torch.tensor([float("nan"), -0.0]).to(DTYPES[dtype])
    got = joined(k[:, 8:24], v[:, 8:24])
    assert got.dtype == k.dtype and got.is_contiguous()
    assert torch.equal(bits(got), bits(torch.cat((k[:, 8:24], v[:, 8:24])).reshape(-1)))
    out = torch.zeros_like(k)
    _ints(out[:, 8:24])[...] = _ints(got[:got.numel() // 2]).reshape(3, 16, 8)
    assert torch.equal(bits(out[:, 8:24]), bits(k[:, 8:24])) and not bits(out[:, :8]).any()
