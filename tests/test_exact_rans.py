"""Exact coding 2 (format 1.5): the remainder rANS-coded per context. The compiled coder and the Python one give the
same bytes and read each other's; every malformed record is one FormatError naming its field, never a crash or a
read outside the record; coding 1 stays available and a 1.4 anchor cannot claim coding 2."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from lynxkv.cache import encode_kv, open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import ChecksumError, FormatError, InputError
from lynxkv.format import constants as c
from lynxkv.format.exact_records import apply_exact_record, encode_exact_layer
from lynxkv.format.writer import build_files
from lynxkv.quant import dequantize, quantize, rans
from lynxkv.quant.scheme import DEFAULT

from exact_helpers import DTYPES, bits, exact_kv, same_bits

compiled_only = pytest.mark.skipif(rans._LIB is None, reason="the compiled coder is not built")


def _pair(dtype, n, seed=3):
    """Originals and predictions of ``n`` elements: many exponents (contexts of both halves and the shared one),
    remainders from 0 to far (every symbol kind), special values, sign flips."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))).to(dtype)
    p = (x.float() * (1 + 0.01 * torch.randn(n, generator=g))).to(dtype)
    x[:7] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-40]).to(dtype)
    p[7:12] = -p[7:12]
    return x, p


@compiled_only
@pytest.mark.parametrize("n", [1, 2, 255, 50_001], ids=["n1", "n2", "n255", "n50001"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_coder_gives_the_reference_bytes(dtype, n):
    x, p = _pair(DTYPES[dtype], max(n, 12))
    x, p = x[:n], p[:n]
    body = rans.encode_body(x, p)
    assert body == rans.reference_encode(x, p)
    assert torch.equal(bits(rans.decode_body(body, p, "t")), bits(x))
    if n <= 2_000:  # the Python decoder loops per element
        assert torch.equal(bits(rans.reference_decode(body, p, "t")), bits(x))


@compiled_only
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compiled_coder_matches_the_reference_at_the_frequency_extremes(dtype):
    """The compiled encoder divides by a symbol's frequency through a reciprocal: the bytes stay the reference's
    for a context of one symbol (frequency 1024), symbols of frequency 1 and power-of-two frequencies, with page
    lengths that leave 1 to 3 elements outside the four-state blocks."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(5)
    for n in (3, 5, 6, 7, 4099):
        x = (torch.randn(n, generator=g) + 3).to(dt)  # one exponent mostly: a big context of each half
        p = x.clone()  # z = 0 everywhere: a single symbol, frequency 1024
        body = rans.encode_body(x, p)
        assert body == rans.reference_encode(x, p)
        assert torch.equal(bits(rans.decode_body(body, p, "t")), bits(x))
        y = x.clone()
        y[::512] = -y[::512]  # a few far remainders: frequency-1 symbols beside a dominant one
        y[1::2] = (y[1::2].float() * (1 + 2 ** -6)).to(dt)  # and half the elements a few units off
        body = rans.encode_body(y, p)
        assert body == rans.reference_encode(y, p)
        assert torch.equal(bits(rans.decode_body(body, p, "t")), bits(y))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_python_coder_round_trips_special_values(dtype, monkeypatch):
    monkeypatch.setattr(rans, "_LIB", None)  # LYNXKV_NATIVE=0
    dt = DTYPES[dtype]
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 3.0e38, -3.0e38, 6e4, 1e-7, -1e-7]).to(dt)
    p = torch.tensor([-0.0, 0.0, -1.0, 1.0, 0.0, 0.0, -3.0e38, 3.0e38, -6e4, 0.0, 1e-7]).to(dt)  # far, sign-flipped
    x = torch.cat((x, torch.tensor([float("nan"), float("inf")]).to(dt)))
    p = torch.cat((p, torch.tensor([1.0, float("-inf")]).to(dt)))
    body = rans.encode_body(x, p)
    assert torch.equal(bits(rans.decode_body(body, p, "t")), bits(x))


def test_frequencies_are_positive_and_sum_to_1024():
    for counts in ([1] * 72, [10**9, 1, 0, 1], [0, 5], [3, 3, 3]):
        f = rans.frequencies(counts)
        assert sum(f) == 1024 and all((v > 0) == (k > 0) for v, k in zip(f, counts))
    assert rans.frequencies([3, 3, 3]) == [342, 341, 341]  # the rest to the first of the most frequent


def test_native_off_writes_the_same_files(monkeypatch):
    """The Python coder (``LYNXKV_NATIVE=0``) writes the compiled coder's exact segment, byte for byte."""
    kv = exact_kv(torch.bfloat16, layers=1, t=40)
    enc = encode_kv(kv)
    first = build_files(enc, cache_id=bytes(16), single_file=True, exact_kv=kv).anchor
    monkeypatch.setattr(rans, "_LIB", None)
    assert build_files(enc, cache_id=bytes(16), single_file=True, exact_kv=kv).anchor == first
    with open_cache(first) as cache:
        assert same_bits(cache.load_kv(exact=True), kv)


def test_rans_is_smaller_than_the_planes_and_stored_raw(tmp_path):
    kv = exact_kv(torch.bfloat16)
    a = save_cache(tmp_path / "a.lynx", kv, exact=True)
    b = save_cache(tmp_path / "b.lynx", kv, exact=True, exact_coding="planes")
    assert a.exact_bytes < b.exact_bytes
    with open_cache(tmp_path / "a.lynx") as cache:
        assert same_bits(cache.load_kv(exact=True), kv)
        assert {e.codec for e in cache._exact().entries} == {c.CODEC_NONE}
    with pytest.raises(InputError, match="exact_coding"):
        save_cache(tmp_path / "c.lynx", kv, exact=True, exact_coding="zstd")


def _predicted(k, v):
    """The full code's decoding of one layer's keys and values, in their dtype."""
    return tuple(dequantize(quantize(t, DEFAULT, kind), DEFAULT, dtype=t.dtype)
                 for t, kind in ((k, "key"), (v, "value")))


# -- malformed records ------------------------------------------------------------------------------------------
def _page(dtype=torch.bfloat16):
    (k, v), = exact_kv(dtype, layers=1, t=32)
    pred = _predicted(k, v)
    both = torch.cat((k, v)).reshape(-1)
    p = torch.cat(pred).reshape(-1)
    return both, p


def _parts(body: bytes, p: torch.Tensor):
    """(offset of the tables, of the first stream, of the extra bits) in a body."""
    _, nctx = rans._contexts(p)
    pos = 4 * rans.STATES
    for _ in range(nctx):
        m = body[pos]
        pos += 1
        for _ in range(m):
            pos += 2 if body[pos] & 0x80 else 1
    return 4 * rans.STATES, pos, pos + sum(struct.unpack_from("<4I", body))


def _cases(body: bytes, p: torch.Tensor):
    tables, stream, extra = _parts(body, p)
    lengths = list(struct.unpack_from("<4I", body))
    le = lambda *n: struct.pack(f"<{len(n)}I", *n)  # noqa: E731
    yield "short", body[:15], "exact.stream_length"
    yield "streams past the end", le(len(body), *lengths[1:]) + body[16:], "exact.stream_length"
    yield "a stream under 4 bytes", le(*lengths[:3], 2) + body[16:], "exact.stream_length"
    yield "no tables", body[:16], "exact.tables"
    yield "symbols 0", body[:tables] + b"\0" + body[tables + 1:], "exact.tables"
    yield "symbols past the alphabet", body[:tables] + bytes([41]) + body[tables + 1:], "exact.tables"
    first = body[tables + 1]  # the first frequency: one byte below 128, else two
    wide = first & 0x80
    bumped = bytes([(first + 1) & 0x7F | wide]) if wide else bytes([first + 1 if first < 127 else first - 1])
    yield "frequencies off 1024", body[:tables + 1] + bumped + body[tables + 2:], "exact.tables"
    if not wide:
        nonminimal = bytes([0x80 | first, 0])
        yield "non-minimal frequency", body[:tables + 1] + nonminimal + body[tables + 2:], "exact.tables"
    yield "last stream cut short", le(*lengths[:3], lengths[3] - 2) + body[16:extra - 2] + body[extra:], "exact.stream"
    yield "a byte after the extra bits", body + b"\0", "exact.extra_bits"
    yield "the last extra byte missing", body[:-1], "exact.extra_bits"
    yield "final state", body[:stream] + bytes([body[stream] ^ 0x01]) + body[stream + 1:], None


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_each_malformed_body_is_one_error_naming_its_field(native, monkeypatch):
    if native and rans._LIB is None:
        pytest.skip("the compiled coder is not built")
    if not native:
        monkeypatch.setattr(rans, "_LIB", None)
    x, p = _page()
    body = rans.encode_body(x, p)
    assert _parts(body, p)[2] < len(body)  # this page has extra bits
    for name, bad, field in _cases(body, p):
        with pytest.raises(FormatError) as exc:
            rans.decode_body(bad, p, "exact layer 0 page 0")
        assert exc.value.field.startswith("exact."), name
        if field is not None:
            assert exc.value.field == field, (name, str(exc.value))
        assert "exact layer 0 page 0" in str(exc.value)


@compiled_only
def test_random_corruption_is_refused_never_a_crash():
    """Flipped bytes, cut and grown records: a FormatError or the rebuild check's ChecksumError, nothing else."""
    x, p = _page(torch.float16)
    n = x.numel() // 2
    pk, pv = p[:n].view(2, 32, 64), p[n:].view(2, 32, 64)
    raw = struct.pack("<I", zlib.crc32(x.view(torch.uint8).numpy().tobytes())) + rans.encode_body(x, p)
    rng = random.Random(5)
    refused = 0
    for _ in range(400):
        bad = bytearray(raw)
        kind = rng.randrange(3)
        if kind == 0:
            for _ in range(rng.randrange(1, 4)):
                bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            bad = bad[:rng.randrange(len(bad))]
        else:
            bad += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        out_k, out_v = torch.empty_like(pk), torch.empty_like(pv)
        try:
            apply_exact_record(bytes(bad), pk, pv, "exact layer 0 page 0", out_k, out_v)
        except (FormatError, ChecksumError):
            refused += 1
    assert refused == 400


def test_a_malformed_record_in_a_file_is_one_clear_line(tmp_path, monkeypatch, capsys):
    """A writer whose rANS stream is cut short (its page CRC valid): the API and the CLI refuse it naming the
    field, before any tensor, and write nothing."""
    import lynxkv.format.exact_records as exact_records

    real = exact_records.encode_body

    def cut(x, p):
        body = real(x, p)
        return body + b"\x07"  # a stray byte after the extra bits

    with monkeypatch.context() as m:
        m.setattr(exact_records, "encode_body", cut)
        save_cache(tmp_path / "c.lynx", exact_kv(torch.bfloat16, layers=1), exact=True)
    with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(FormatError) as exc:
        cache.load_kv(exact=True)
    assert exc.value.field == "exact.extra_bits"
    assert [f.field for f in verify_file(tmp_path / "c.lynx")][:1] == ["exact.extra_bits"]
    assert main(["decode", str(tmp_path / "c.lynx"), "-o", str(tmp_path / "x.safetensors"), "--exact"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("lynxkv: error:") and "exact.extra_bits" in err[0]
    assert not (tmp_path / "x.safetensors").exists()


def test_coding_2_in_a_1_4_anchor_is_refused(tmp_path):
    kv = exact_kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, DEFAULT.replace(extremes="midpoint"), exact=True)  # no 1.6 flag
    data = bytearray((tmp_path / "c.lynx").read_bytes())
    assert data[10] == c.MINOR_EXACT_RANS
    data[10] = c.MINOR_EXACT
    length = struct.unpack_from("<I", data, 16)[0]
    data[length - 4:length] = struct.pack("<I", zlib.crc32(bytes(data[:length - 4])))
    (tmp_path / "c.lynx").write_bytes(bytes(data))
    with open_cache(tmp_path / "c.lynx") as cache:
        assert same_bits(cache.load_kv(), cache.load_kv())  # the anchor and the residual still read
        with pytest.raises(FormatError, match="only in a file of version 1.5") as exc:
            cache.load_kv(exact=True)
    assert exc.value.field == "coding"


def test_a_raw_length_outside_the_bounds_of_coding_2_is_refused():
    from lynxkv.format.layout import PageEntry, pack_index, parse_index

    for raw in (c.EXACT_RANS_MIN_RECORD - 1, 1001):
        entry = pack_index([PageEntry(0, raw, raw, c.CODEC_NONE, 0)])
        with pytest.raises(FormatError) as exc:
            parse_index(entry, 1, first_offset=0, section_length=2000, raw_lengths=[1000], segment="exact",
                        pages_per_layer=1, index_at=72, raw_at_least=c.EXACT_RANS_MIN_RECORD)
        assert exc.value.field == "page.raw_length"


def test_encode_exact_layer_codings_rebuild_the_same_page():
    (k, v), = exact_kv(torch.float32, layers=1, t=20)
    pred = _predicted(k, v)
    for coding in (c.EXACT_CODING_PLANES, c.EXACT_CODING_RANS):
        (record, splits), = encode_exact_layer((k, v), pred, DEFAULT.page, 20, coding)
        assert (splits is None) == (coding == c.EXACT_CODING_RANS)
        out_k, out_v = torch.empty_like(k), torch.empty_like(v)
        apply_exact_record(record, pred[0], pred[1], "exact layer 0 page 0", out_k, out_v, coding)
        assert torch.equal(bits(out_k), bits(k)) and torch.equal(bits(out_v), bits(v))


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_pages_rebuilt_on_workers_are_bit_identical_and_the_first_bad_page_is_reported(tmp_path, monkeypatch,
                                                                                         threads):
    """The writer codes and ``load_kv(exact=True)`` rebuilds exact pages on ``LYNXKV_CPU_THREADS`` workers: the
    same bytes and tensors as one worker, and of two malformed pages (valid page CRCs) the first one's error,
    whatever the workers finish first."""
    import lynxkv.format.exact_records as exact_records

    kv = exact_kv(torch.bfloat16, t=700)  # 3 layers of 3 pages
    monkeypatch.setenv("LYNXKV_CPU_THREADS", "1")
    one = build_files(encode_kv(kv), cache_id=bytes(16), single_file=True, exact_kv=kv).anchor
    monkeypatch.setenv("LYNXKV_CPU_THREADS", threads)
    assert build_files(encode_kv(kv), cache_id=bytes(16), single_file=True, exact_kv=kv).anchor == one
    with open_cache(one) as cache:
        assert same_bits(cache.load_kv(exact=True), kv)
    real, calls = exact_records.encode_body, []

    def broken(x, p):  # page 1 of layer 0 gains a stray byte, page 1 of layer 2 loses its last one
        calls.append(1)
        body = real(x, p)
        return {2: body + b"\x01", 8: body[:-1]}.get(len(calls), body)

    with monkeypatch.context() as m:  # written on one worker, so that the calls come in page order
        m.setenv("LYNXKV_CPU_THREADS", "1")
        m.setattr(exact_records, "encode_body", broken)
        save_cache(tmp_path / "c.lynx", kv, exact=True)
    with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(FormatError) as exc:
        cache.load_kv(exact=True)
    assert exc.value.field == "exact.extra_bits" and "exact layer 0 page 1" in str(exc.value)


def test_lynxkv_native_0_writes_and_reads_the_same_bytes(tmp_path):
    """With ``LYNXKV_NATIVE=0`` (no compiled code at all) the exact segment's bytes are the compiled writer's and
    it reads back bit for bit."""
    kv = exact_kv(torch.float16, layers=1, t=24)
    compiled = build_files(encode_kv(kv), cache_id=bytes(16), single_file=True, exact_kv=kv).anchor
    (tmp_path / "compiled.lynx").write_bytes(compiled)
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1])\n"
        "from exact_helpers import exact_kv, same_bits\n"
        "from lynxkv.cache import encode_kv, open_cache\n"
        "from lynxkv.format.writer import build_files\n"
        "from lynxkv.quant import rans\n"
        "assert rans._LIB is None\n"
        "kv = exact_kv(torch.float16, layers=1, t=24)\n"
        "data = build_files(encode_kv(kv), cache_id=bytes(16), single_file=True, exact_kv=kv).anchor\n"
        "assert data == open(sys.argv[2], 'rb').read()\n"
        "with open_cache(data) as cache:\n"
        "    assert same_bits(cache.load_kv(exact=True), kv)\n"
    )
    env = dict(os.environ, LYNXKV_NATIVE="0")
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "compiled.lynx")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
