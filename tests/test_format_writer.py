"""The streaming writer: save_cache writes, layer by layer, the bytes build_files gives in memory."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from lynxkv.cache import encode_kv, save_cache
from lynxkv.errors import InputError
from lynxkv.format.writer import Parts, build_files, write_files
from lynxkv.quant import dequantize, quantize
from lynxkv.quant.scheme import DEFAULT, PAPER, Scheme
from lynxkv.storage import AtomicWriter, read_range, size_of
from lynxkv.storage import atomic

CID = bytes(range(16))


def make_kv(layers=3, heads=2, tokens=600, dim=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, tokens, dim, generator=g).to(dtype) * 2 + 1,
             torch.randn(heads, tokens, dim, generator=g).to(dtype)) for _ in range(layers)]


@pytest.mark.parametrize("scheme,dim", [(DEFAULT, 64), (DEFAULT, 62), (PAPER, 64), (DEFAULT, 63),
                                        (Scheme(anchor_bits=5, residual_bits=3), 64)],
                         ids=["default", "default-d62", "paper", "odd-dim-unpacked", "5+3-unpacked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("single,zstd", [(False, False), (True, False), (False, True)],
                         ids=["two-files", "single-file", "zstd"])
def test_save_cache_writes_the_bytes_build_files_gives(tmp_path, scheme, dim, dtype, single, zstd):
    kv = make_kv(dim=dim, dtype=dtype)
    path = tmp_path / "c.lynx"
    save_cache(path, kv, scheme, cache_id=CID, single_file=single, zstd=zstd)
    built = build_files(encode_kv(kv, scheme), cache_id=CID, single_file=single, zstd=zstd,
                        residual_location="c.lynxr")
    assert path.read_bytes() == built.anchor
    if single:
        assert not (tmp_path / "c.lynxr").exists()
    else:
        assert (tmp_path / "c.lynxr").read_bytes() == built.residual
    assert sorted(p.name for p in tmp_path.iterdir()) == (["c.lynx"] if single else ["c.lynx", "c.lynxr"])


def test_write_files_into_an_object_store_writes_the_same_bytes():
    enc = encode_kv(make_kv(layers=2))
    anchor, residual = AtomicWriter("memory://writer/c.lynx"), AtomicWriter("memory://writer/c.lynxr")
    write_files(enc, anchor, residual, cache_id=CID, residual_location="c.lynxr")
    residual.commit()
    anchor.commit()
    built = build_files(enc, cache_id=CID, residual_location="c.lynxr")
    for url, want in (("memory://writer/c.lynx", built.anchor), ("memory://writer/c.lynxr", built.residual)):
        assert read_range(url, 0, size_of(url)) == want


class _Watched:
    """An encoded cache whose layers record how many bytes the sinks held when each was read."""

    def __init__(self, enc, sinks):
        self._enc, self._sinks, self.seen = enc, sinks, []
        self.layers = self

    def __getattr__(self, name):
        return getattr(self._enc, name)

    def __len__(self):
        return len(self._enc.layers)

    def __getitem__(self, i):
        pair = self._enc.layers[i]  # IndexError ends the iteration
        self.seen.append(tuple(s.size for s in self._sinks))
        return pair


def test_write_files_writes_each_layer_before_it_reads_the_next():
    enc = encode_kv(make_kv(layers=4))
    anchor, residual = Parts(), Parts()
    watched = _Watched(enc, (anchor, residual))
    write_files(watched, anchor, residual, cache_id=CID, residual_location="c.lynxr")
    sizes = watched.seen
    assert len(sizes) == 4
    # before layer 0 only the reserved leads; then every layer's pages went out before the next layer was read
    assert all(b[0] > a[0] and b[1] > a[1] for a, b in zip(sizes, sizes[1:]))
    built = build_files(enc, cache_id=CID, residual_location="c.lynxr")
    assert b"".join(anchor.parts) == built.anchor and b"".join(residual.parts) == built.residual


def test_packed_codes_are_the_records_bytes_and_unpack_to_the_codes():
    x = torch.randn(3, 100, 64).to(torch.bfloat16)
    for kind in ("key", "value"):
        plain, packed = quantize(x, DEFAULT, kind), quantize(x, DEFAULT, kind, packed=True)
        assert packed.packed and not plain.packed and packed.shape == plain.shape == (3, 100, 64)
        assert (packed.axis, packed.sinks, packed.rotated) == (plain.axis, plain.sinks, plain.rotated)
        un = packed.unpacked()
        assert torch.equal(un.anchor, plain.anchor) and torch.equal(un.residual, plain.residual)
        assert torch.equal(packed.offset, plain.offset) and torch.equal(packed.scale, plain.scale)
        for anchor_only in (False, True):
            assert torch.equal(dequantize(packed, DEFAULT, anchor_only=anchor_only),
                               dequantize(plain, DEFAULT, anchor_only=anchor_only))
    odd = quantize(torch.randn(2, 10, 63), DEFAULT, packed=True)  # an odd head_dim does not pack
    assert not odd.packed and odd.anchor.shape == (2, 10, 63)


def test_atomic_writer_fills_its_reserve_and_syncs_in_the_background_as_it_goes(tmp_path, monkeypatch):
    synced, ran = [], threading.Event()
    real = os.fdatasync

    def fdatasync(fd):
        synced.append(os.fstat(fd).st_size)
        real(fd)
        ran.set()

    monkeypatch.setattr(atomic, "WRITEBACK_BYTES", 1 << 16)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    path = tmp_path / "f.bin"
    body = bytes(range(256)) * 1024  # 256 KiB, in 16 writes
    with AtomicWriter(path) as w:
        at = w.reserve(8)
        for i in range(16):
            w.write(body[i * 16384:(i + 1) * 16384])
        assert ran.wait(10) and not path.exists()  # synced in the background before the commit
        w.fill(at, b"HEADER!!")
    assert path.read_bytes() == b"HEADER!!" + body
    assert 1 <= len(synced) <= 4 and synced == sorted(synced)  # kicks while a sync runs fold into the next one


def test_a_background_sync_error_fails_the_commit_and_leaves_nothing(tmp_path, monkeypatch):
    failed = threading.Event()

    def full(fd):
        failed.set()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "WRITEBACK_BYTES", 1 << 12)
    monkeypatch.setattr(os, "fdatasync", full)
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    w = AtomicWriter(path)
    w.write(bytes(1 << 13))
    assert failed.wait(10)  # the background sync ran (and failed) before the commit; the final fsync would pass
    with pytest.raises(InputError, match="no space left"):
        w.commit()
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_failed_streaming_save_leaves_nothing_and_the_old_cache(tmp_path):
    path = tmp_path / "c.lynx"
    save_cache(path, make_kv(layers=2), cache_id=CID)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    bad = make_kv(layers=3)
    bad[2][0][0, 5, 3] = float("inf")  # the last layer fails to quantize, after two layers were written
    with pytest.raises(Exception, match="inf or NaN"):
        save_cache(path, bad)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("threads", ["1", "3"])
def test_layers_quantized_side_by_side_write_the_same_bytes(tmp_path, monkeypatch, threads):
    monkeypatch.setenv("LYNXKV_CPU_THREADS", threads)  # 3: three layers quantized at once, each on one thread
    kv = make_kv(layers=7, tokens=300)
    save_cache(tmp_path / "c.lynx", kv, cache_id=CID)
    built = build_files(encode_kv(kv), cache_id=CID, residual_location="c.lynxr")
    assert (tmp_path / "c.lynx").read_bytes() == built.anchor
    assert (tmp_path / "c.lynxr").read_bytes() == built.residual


def test_atomic_writer_counts_bytes_of_any_buffer(tmp_path):
    import numpy as np

    words = np.arange(4, dtype=np.int32)  # 16 bytes, 4 items
    with AtomicWriter(tmp_path / "f.bin") as w:
        w.write(words)
        assert w.reserve(2) == words.nbytes
        w.write(b"end")
        w.fill(words.nbytes, b"::")
    assert (tmp_path / "f.bin").read_bytes() == words.tobytes() + b"::end"


@pytest.mark.parametrize("tokens", [1024, 1000, 200, 257], ids=["whole-pages", "partial-last", "one-partial", "P+1"])
@pytest.mark.parametrize("scheme", [DEFAULT, DEFAULT.replace(sink_tokens=0), DEFAULT.replace(value_axis="token"),
                                    DEFAULT.replace(meta_dtype="fp32", chunk=16, page=64),
                                    DEFAULT.replace(sink_tokens=300)],
                         ids=["default", "no-sinks", "values-along-tokens", "fp32meta-C16-P64", "sinks-past-a-page"])
def test_layer_records_are_the_page_records(scheme, tokens):
    """encode_layer_records (every full page of packed codes laid out by one strided copy per part) gives each
    page the bytes encode_anchor_record / encode_residual_record give its slices, in page order: the pages with
    sink tokens, the batched full pages and a last partial page."""
    from lynxkv.format.records import encode_anchor_record, encode_layer_records, encode_residual_record

    g = torch.Generator().manual_seed(tokens)
    k, v = (torch.randn(3, tokens, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    ke, ve = (quantize(t, scheme, kind, packed=True) for t, kind in ((k, "key"), (v, "value")))
    assert ke.packed and ve.packed
    got = list(encode_layer_records(ke, ve, scheme, tokens))
    assert len(got) == -(-tokens // scheme.page)
    for p, (a, r) in enumerate(got):
        start, stop = p * scheme.page, min((p + 1) * scheme.page, tokens)
        ks, vs = ke.tokens(start, stop, scheme.chunk), ve.tokens(start, stop, scheme.chunk)
        assert bytes(a) == encode_anchor_record(ks, vs, scheme), f"page {p}: anchor record"
        assert bytes(r) == encode_residual_record(ks, vs, scheme), f"page {p}: residual record"
