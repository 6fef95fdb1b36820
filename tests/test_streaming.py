"""Caches larger than memory: writing a cache from a stream of layers (:func:`lynxkv.save_cache_layers`, ``lynxkv
encode`` of a dump), reading it back a few layers at a time (:meth:`lynxkv.LynxCache.iter_layers`, ``lynxkv decode``)
give the bytes and tensors the in-memory paths give; bad input leaves nothing behind."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import lynxkv
from lynxkv.cache.dumps import load_kv_safetensors, save_kv_safetensors
from cli_helpers import one_error, run_cli

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CACHE_ID = bytes(range(16))


def _kv(layers=3, heads=2, tokens=70, dim=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple((torch.randn(heads, tokens, dim, generator=g) * (1 + i)).to(dtype) for _ in range(2))
            for i in range(layers)]


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _files(d) -> dict[str, str]:
    return {n: _digest(os.path.join(d, n)) for n in sorted(os.listdir(d))}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("options", [{}, {"single_file": True}, {"exact": True},
                                     {"single_file": True, "exact": True, "zstd": True}],
                         ids=["two-files", "single-file", "exact", "single-file-exact-zstd"])
def test_save_cache_layers_writes_the_bytes_save_cache_writes(tmp_path, dtype, options):
    kv = _kv(dtype=dtype)
    (tmp_path / "mem").mkdir()
    (tmp_path / "stream").mkdir()
    lynxkv.save_cache(tmp_path / "mem" / "c.lynx", kv, cache_id=CACHE_ID, **options)
    info = lynxkv.save_cache_layers(tmp_path / "stream" / "c.lynx", (pair for pair in kv), count=len(kv),
                                    cache_id=CACHE_ID, **options)
    assert info.layers == len(kv) and info.tokens == kv[0][0].shape[1]
    assert _files(tmp_path / "stream") == _files(tmp_path / "mem")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("window", [1, 2, None], ids=["window1", "window2", "default"])
def test_iter_layers_gives_load_kvs_tensors(tmp_path, dtype, window):
    kv = _kv(layers=5, dtype=dtype)
    lynxkv.save_cache(tmp_path / "c.lynx", kv, exact=True)
    with lynxkv.open_cache(tmp_path / "c.lynx") as c:
        for options in ({}, {"anchor_only": True}, {"exact": True}, {"dtype": torch.float32}):
            whole = c.load_kv(**options)
            layers = c.iter_layers(window=window, **options)
            streamed = list(layers)
            assert len(streamed) == len(whole)
            for (k, v), (sk, sv) in zip(whole, streamed):
                assert torch.equal(k, sk) and torch.equal(v, sv) and sk.dtype == k.dtype, options


@pytest.mark.parametrize("window", [1, 2, 4], ids=["window1", "window2", "window4"])
@pytest.mark.parametrize("options", [{}, {"anchor_only": True}, {"exact": True}], ids=["full", "anchor", "exact"])
def test_recycled_layers_give_load_kvs_values_and_are_decoded_into_again(tmp_path, window, options):
    kv = _kv(layers=6)
    lynxkv.save_cache(tmp_path / "c.lynx", kv, exact=True)
    with lynxkv.open_cache(tmp_path / "c.lynx") as c:
        whole = c.load_kv(**options)
        kept, copies = [], []
        for k, v in c.iter_layers(window=window, recycle=True, **options):
            kept.append((k, v))
            copies.append((k.clone(), v.clone()))  # what a consumer takes before asking for the next layer
    assert all(torch.equal(a, b) for pair, copy in zip(whole, copies) for a, b in zip(pair, copy))
    # the tensors of an early layer were decoded into again: they hold a later layer's values now
    assert kept[0][0].data_ptr() in {k.data_ptr() for k, _ in kept[1:]}
    assert not torch.equal(kept[0][0], whole[0][0])


def test_iter_layers_exact_rebuilds_the_originals(tmp_path):
    kv = _kv(layers=4, dtype=torch.bfloat16)
    lynxkv.save_cache_layers(tmp_path / "c.lynx", iter(kv), count=4, exact=True)
    with lynxkv.open_cache(tmp_path / "c.lynx") as c:
        for (k, v), (ek, ev) in zip(kv, c.iter_layers(exact=True, window=1)):
            assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize("layers, why", [
    (lambda kv: kv[:2], "2 layers given, 3 declared"),
    (lambda kv: kv + kv[:1], "more than the 3 layers declared"),
    (lambda kv: kv[:2] + [(kv[2][0][:, :10], kv[2][1][:, :10])], "differs from layer 0 keys"),
    (lambda kv: kv[:2] + [(kv[2][0].float(), kv[2][1].float())], "differs from layer 0 keys"),
], ids=["too-few", "too-many", "short-layer", "other-dtype"])
@pytest.mark.parametrize("single_file", [False, True], ids=["two-files", "single-file"])
def test_a_bad_stream_of_layers_leaves_nothing(tmp_path, layers, why, single_file):
    kv = _kv()
    with pytest.raises(lynxkv.InputError, match=why):
        lynxkv.save_cache_layers(tmp_path / "c.lynx", iter(layers(kv)), count=3, single_file=single_file, exact=True)
    assert os.listdir(tmp_path) == []


def test_a_stream_of_layers_needs_its_count(tmp_path):
    with pytest.raises(lynxkv.InputError, match="count"):
        lynxkv.save_cache_layers(tmp_path / "c.lynx", iter(_kv()))
    info = lynxkv.save_cache_layers(tmp_path / "c.lynx", _kv())  # a list has a length
    assert info.layers == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("batched", [False, True], ids=["HTD", "1HTD"])
def test_cli_encode_decode_of_a_dump_equal_the_in_memory_path(tmp_path, capsys, dtype, batched):
    kv = _kv(layers=4, dtype=dtype)
    dump = tmp_path / "kv.safetensors"
    save_file({f"past_key_values.{i}.{kind}": (t.unsqueeze(0) if batched else t)
               for i, pair in enumerate(kv) for kind, t in zip(("key", "value"), pair)}, dump, metadata={"m": "x"})
    assert run_cli(capsys, "encode", dump, "-o", tmp_path / "c.lynx", "--exact")[0] == 0
    code, _, err = run_cli(capsys, "verify", tmp_path / "c.lynx")
    assert code == 0 and "OK" in err
    with lynxkv.open_cache(tmp_path / "c.lynx") as c:  # the in-memory path, for comparison
        info = c.info
        expected = {mode: c.load_kv(anchor_only=mode == "anchor", exact=mode == "exact")
                    for mode in ("full", "anchor", "exact")}
    for mode, flags in (("full", []), ("anchor", ["--anchor-only"]), ("exact", ["--exact"])):
        out = tmp_path / f"{mode}.safetensors"
        assert run_cli(capsys, "decode", tmp_path / "c.lynx", "-o", out, *flags)[0] == 0
        ref = tmp_path / f"{mode}.ref.safetensors"
        save_kv_safetensors(ref, expected[mode], info.names, batched=info.batch_dim,
                            metadata={**info.properties, "lynxkv.cache_id": info.cache_id,
                                      "lynxkv.reconstruction": mode})
        assert _digest(out) == _digest(ref), mode
        back = load_file(out)
        assert set(back) == {f"past_key_values.{i}.{kind}" for i in range(4) for kind in ("key", "value")}
        assert all(t.shape == ((1,) if batched else ()) + kv[0][0].shape and t.dtype == dtype for t in back.values())
    back, naming = load_kv_safetensors(tmp_path / "exact.safetensors")
    assert naming.batched == batched and dict(naming.metadata)["m"] == "x"
    assert all(torch.equal(a, b) for pair, bpair in zip(kv, back) for a, b in zip(pair, bpair))


PAGE_BYTES = 2 * 3 * 64 * 16 * (2 + 4 + 1)  # one page of 64 tokens, keys and values of 3 heads x 16, as encode counts


@pytest.mark.parametrize("scheme", [{"page": 64}, {"page": 64, "chunk": 16, "key_rotation": "none"},
                                    {"name": "paper", "page": 64}], ids=["default", "unrotated-c16", "paper"])
@pytest.mark.parametrize("memory", [PAGE_BYTES, 2 * PAGE_BYTES, 7 * PAGE_BYTES, None],
                         ids=["one-page", "two-pages", "seven-pages", "default"])
@pytest.mark.parametrize("options", [{}, {"exact": True}, {"single_file": True, "exact": True, "zstd": True}],
                         ids=["two-files", "exact", "single-file-exact-zstd"])
def test_a_dump_encoded_in_pieces_writes_the_bytes_save_cache_writes(tmp_path, scheme, memory, options):
    """A layer of 333 tokens is 6 pages, the last of 13 tokens: encoded a page, two pages or a few at a time
    (the pieces of two workers in flight), or whole, the files are those of the in-memory save_cache, byte for
    byte; the default scheme's 4 sink tokens and rotated keys included."""
    from lynxkv.quant.scheme import get_scheme

    sch = get_scheme(**{"name": "default", **scheme})
    kv = _kv(layers=3, heads=3, tokens=333, dim=16)
    dump = _dump(tmp_path, kv)
    (tmp_path / "mem").mkdir()
    (tmp_path / "dump").mkdir()
    names = [f"layers.{i}.{kind}" for i in range(3) for kind in ("key", "value")]
    lynxkv.save_cache(tmp_path / "mem" / "c.lynx", kv, sch, cache_id=CACHE_ID, names=names, **options)
    info = lynxkv.cache.save_dump(dump, tmp_path / "dump" / "c.lynx", sch, memory=memory, cache_id=CACHE_ID,
                                  **options)
    assert (info.layers, info.tokens, info.pages_per_layer) == (3, 333, 6)
    assert _files(tmp_path / "dump") == _files(tmp_path / "mem")


def test_encode_takes_less_than_a_layer_of_memory_and_refuses_less_than_a_page(tmp_path, capsys):
    kv = _kv(layers=2, heads=3, tokens=333, dim=16)
    dump = _dump(tmp_path, kv)
    lynxkv.save_cache(tmp_path / "mem.lynx", kv, cache_id=CACHE_ID)
    err = one_error(capsys, "encode", dump, "-o", tmp_path / "c.lynx", "--memory", str(4 * PAGE_BYTES - 1))
    assert "one page" in err and f"{4 * PAGE_BYTES:,}" in err  # pages of 256 tokens: 4 of 64
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors", "mem.lynx", "mem.lynxr"]
    assert run_cli(capsys, "encode", dump, "-o", tmp_path / "c.lynx", "--memory", str(4 * PAGE_BYTES))[0] == 0
    with lynxkv.open_cache(tmp_path / "c.lynx") as c, lynxkv.open_cache(tmp_path / "mem.lynx") as m:
        for (k, v), (mk, mv) in zip(c.iter_layers(), m.iter_layers()):
            assert torch.equal(k, mk) and torch.equal(v, mv)


def _dump(tmp_path, kv=None):
    dump = tmp_path / "kv.safetensors"
    save_kv_safetensors(dump, kv or _kv(layers=4))
    return dump


def test_a_truncated_dump_is_one_error_and_no_output(tmp_path, capsys):
    dump = _dump(tmp_path)
    data = dump.read_bytes()
    dump.write_bytes(data[:len(data) - 100])
    err = one_error(capsys, "encode", dump, "-o", tmp_path / "c.lynx")
    assert "kv.safetensors" in err
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors"]


def test_a_dump_of_mixed_shapes_is_one_error_and_no_output(tmp_path, capsys):
    kv = _kv(layers=3)
    tensors = {f"layers.{i}.{kind}": t for i, pair in enumerate(kv) for kind, t in zip(("key", "value"), pair)}
    tensors["layers.2.value"] = tensors["layers.2.value"][:, :50].contiguous()
    save_file(tensors, tmp_path / "kv.safetensors")
    err = one_error(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "c.lynx")
    assert "differ in shape" in err
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors"]


def test_a_damaged_cache_decodes_to_one_error_and_no_output(tmp_path, capsys):
    lynxkv.save_cache(tmp_path / "c.lynx", _kv(layers=4))
    data = bytearray((tmp_path / "c.lynx").read_bytes())
    data[-5] ^= 0xFF  # a byte of the last layer's last anchor page: found only when that layer is reached
    (tmp_path / "c.lynx").write_bytes(bytes(data))
    err = one_error(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "out.safetensors")
    assert "layer 3" in err
    assert sorted(os.listdir(tmp_path)) == ["c.lynx", "c.lynxr"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root on Linux); skipped where it cannot be mounted."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("command", ["encode", "encode-single", "decode"])
def test_a_full_disk_is_one_error_and_no_output(tmp_path, capsys, tiny_disk, command):
    dump = _dump(tmp_path, _kv(layers=8, heads=4, tokens=1000, dim=64))  # 8 MB, the disk holds 1
    if command.startswith("encode"):
        argv = ["encode", dump, "-o", tiny_disk / "c.lynx"] + (["--single-file"] if command == "encode-single" else [])
    else:
        lynxkv.cache.save_dump(dump, tmp_path / "c.lynx")
        argv = ["decode", tmp_path / "c.lynx", "-o", tiny_disk / "out.safetensors"]
    err = one_error(capsys, *argv)
    assert "no space left" in err
    assert [n for n in os.listdir(tiny_disk) if not n.startswith(".lynx")] == [], os.listdir(tiny_disk)
    assert not any(n.endswith(".tmp") for n in os.listdir(tiny_disk))


def test_memory_bounds_the_window_and_refuses_less_than_a_layer(tmp_path, capsys):
    kv = _kv(layers=5, heads=2, tokens=300, dim=32)
    dump = _dump(tmp_path, kv)
    page_in = 2 * 2 * 256 * 32 * 2  # one page's keys and values in BF16: 65,536 bytes
    err = one_error(capsys, "encode", dump, "-o", tmp_path / "c.lynx", "--memory", str(page_in))
    assert "one page" in err and "memory" in err  # encode works on pieces of whole pages, at least one
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors"]
    assert run_cli(capsys, "encode", dump, "-o", tmp_path / "c.lynx", "--exact", "--memory", "1MiB")[0] == 0
    with lynxkv.open_cache(tmp_path / "c.lynx") as c:
        one_layer = c.layer_bytes()
        assert c.layer_bytes(anchor_only=True) < one_layer < c.layer_bytes(dtype=torch.float32)
        assert [k.shape for k, _ in c.iter_layers(window=1)] == [kv[0][0].shape] * 5
    err = one_error(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "o.safetensors", "--memory",
                    str(one_layer - 1))
    assert "one layer" in err and not (tmp_path / "o.safetensors").exists()
    err = one_error(capsys, "verify", tmp_path / "c.lynx", "--memory", str(one_layer - 1))
    assert "one layer" in err
    assert run_cli(capsys, "verify", tmp_path / "c.lynx", "--memory", str(one_layer))[0] == 0
    for memory in (one_layer, 3 * one_layer, None):
        out = tmp_path / f"o{memory}.safetensors"
        assert run_cli(capsys, "decode", tmp_path / "c.lynx", "-o", out, "--exact",
                       *(["--memory", str(memory)] if memory else []))[0] == 0
    assert len({_digest(tmp_path / f"o{m}.safetensors") for m in (one_layer, 3 * one_layer, None)}) == 1
    back, _ = load_kv_safetensors(tmp_path / f"o{one_layer}.safetensors")
    assert all(torch.equal(a, b) for pair, bpair in zip(kv, back) for a, b in zip(pair, bpair))


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_a_window_is_a_number_of_layers(tmp_path, window):
    lynxkv.save_cache(tmp_path / "c.lynx", _kv())
    with lynxkv.open_cache(tmp_path / "c.lynx") as c, pytest.raises(lynxkv.InputError, match="window"):
        c.iter_layers(window=window)
    with pytest.raises(lynxkv.InputError, match="window"):
        lynxkv.save_cache_layers(tmp_path / "d.lynx", _kv(), window=window)


def test_the_error_against_a_dump_is_computed_layer_by_layer_as_in_memory(tmp_path):
    from lynxkv.eval.metrics import kv_error, reconstruction_error

    kv = _kv(layers=4)
    dump = _dump(tmp_path, kv)
    lynxkv.cache.save_dump(dump, tmp_path / "c.lynx")
    with lynxkv.open_cache(tmp_path / "c.lynx") as c:
        expected = kv_error(c.load_kv(dtype=torch.float32), c.load_kv(anchor_only=True, dtype=torch.float32), kv)
    assert reconstruction_error(tmp_path / "c.lynx", dump) == expected
    other = tmp_path / "other.safetensors"
    save_kv_safetensors(other, _kv(layers=3))
    with pytest.raises(lynxkv.InputError, match="the original has 3 layers"):
        reconstruction_error(tmp_path / "c.lynx", other)
