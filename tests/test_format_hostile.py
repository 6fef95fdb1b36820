"""Hostile files against the CLI: a corpus of crafted caches (traversal and foreign locations, FIFOs, symlinks,
zstd bombs, NaN metadata, bad names, oversized shapes), each with the one clean error it must give; crashes and
a full disk while replacing a cache; and a bounded-time fuzz test over re-sealed headers.

Each case is built with the project's own writer (so every checksum is valid and the reader gets past them) and
then made hostile in one way."""

from __future__ import annotations

import dataclasses
import errno
import http.server
import json
import os
import random
import struct
import threading
import time
import zlib

import pytest
import torch

import lynxkv.format.records as records
import lynxkv.format.writer as writer
from lynxkv.cache import encode_kv, open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import LynxError
from lynxkv.format.writer import build_files
from lynxkv.quant.scheme import Scheme

SCHEME = Scheme(chunk=4, page=8)
SECRET = b"SECRET-CONTENT-OF-A-FOREIGN-FILE\n" * 4


def kv(seed: int = 0, tokens: int = 20):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 4, generator=g), torch.randn(2, tokens, 4, generator=g)) for _ in range(2)]


def one_error(stderr: str) -> str:
    """The one ``lynxkv: error:`` line (and no traceback) the CLI printed."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("lynxkv: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- the corpus: each builder writes c.lynx (+ whatever it needs) into a directory ----------------------------
def _write(d, built, residual_name: str | None = "c.lynxr"):
    (d / "c.lynx").write_bytes(built.anchor)
    if built.residual is not None and residual_name:
        (d / residual_name).write_bytes(built.residual)


def location_case(location: str):
    def build(d, outside):
        built = build_files(encode_kv(kv(), SCHEME), residual_location=location(outside) if callable(location)
                            else location)
        _write(d, built, None)
        (outside / "c.lynxr").write_bytes(built.residual)  # a valid residual, but where it may not be followed
        (outside / "passwd").write_bytes(SECRET)
    return build


def fifo_residual(d, outside):
    _write(d, build_files(encode_kv(kv(), SCHEME), residual_location="c.lynxr"), None)
    os.mkfifo(d / "c.lynxr")


def symlink_escape(d, outside):
    built = build_files(encode_kv(kv(), SCHEME), residual_location="c.lynxr")
    _write(d, built, None)
    (outside / "real.lynxr").write_bytes(built.residual)
    os.symlink(outside / "real.lynxr", d / "c.lynxr")


def zstd_bomb(d, outside, monkeypatch):
    """Every page a zstd frame that inflates to 64x its record: the index and CRCs are the writer's own."""
    import zstandard

    monkeypatch.setattr(records, "compress", lambda raw, codec, level=3: zstandard.ZstdCompressor(
        level=19, write_content_size=False).compress(bytes(len(raw) * 64)))
    _write(d, build_files(encode_kv(kv(), SCHEME), residual_location="c.lynxr", zstd=True))


def metadata_case(field: str, value: float):
    def build(d, outside):
        enc = encode_kv(kv(), SCHEME)
        getattr(enc.layers[1][0], field)[0, 1, 2] = value
        _write(d, build_files(enc, residual_location="c.lynxr"))
    return build


def names_case(names):
    def build(d, outside, monkeypatch):
        monkeypatch.setattr(writer, "names_problem", lambda names, layers: None)  # a writer without the check
        _write(d, build_files(encode_kv(kv(), SCHEME, names=names), residual_location="c.lynxr"))
    return build


def properties_case(data: bytes):
    """A header whose properties string is ``data`` (a writer that would write anything there)."""
    def build(d, outside, monkeypatch):
        import lynxkv.format.headers as headers

        monkeypatch.setattr(headers, "pack_properties", lambda properties: data)
        enc = dataclasses.replace(encode_kv(kv(), SCHEME), properties={"k": "v"})
        _write(d, build_files(enc, residual_location="c.lynxr"))
    return build


# id, builder, what `verify` must report (a finding's field / message part), what `decode` must say
CORPUS = [
    ("traversal-location", location_case("../outside/c.lynxr"), "location", "leads outside"),
    ("absolute-location", location_case(lambda o: str(o / "passwd")), "location", "outside the anchor's directory"),
    ("url-location", location_case("http://127.0.0.1:{port}/c.lynxr"), "location", "outside the anchor's directory"),
    ("fifo-residual", fifo_residual, "location", "not a regular file"),
    ("symlink-escape", symlink_escape, "location", "leads outside"),
    ("zstd-bomb", zstd_bomb, "page.raw_length", "inflates past"),
    ("nan-scale", metadata_case("scale", float("nan")), "key_scale", "NaN or infinity"),
    ("inf-offset", metadata_case("offset", float("inf")), "key_offset", "NaN or infinity"),
    ("negative-scale", metadata_case("scale", -1.0), "key_scale", "scales >= 0"),
    ("duplicate-names", names_case(["k0", "v0", "k0", "v1"]), "names", "twice"),
    ("empty-name", names_case(["k0", "", "k1", "v1"]), "names", "non-empty"),
    ("metadata-name", names_case(["k0", "v0", "__metadata__", "v1"]), "names", "__metadata__"),
    ("nul-in-location", location_case("c.lynxr\0"), "location", "control characters"),
    ("newline-in-location", location_case("c\nlynxkv: error: forged.lynxr"), "location", "control characters"),
    ("escape-in-location", location_case("c\x1b[2J.lynxr"), "location", "control characters"),
    ("deeply-nested-properties", properties_case(b"[" * 60000 + b"]" * 5536), "properties", "a JSON object"),
    ("surrogate-in-properties", properties_case(b'{"k":"\\ud800"}'), "properties", "text values"),
    ("repeated-property-key", properties_case(b'{"k":"a","k":"b"}'), "properties", "all different"),
]


class _CountingHandler(http.server.BaseHTTPRequestHandler):
    hits: list = []

    def do_GET(self):  # noqa: N802
        _CountingHandler.hits.append(self.path)
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def http_port():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _CountingHandler.hits = []
    yield srv.server_address[1]
    srv.shutdown()


@pytest.fixture
def hostile(tmp_path, monkeypatch, http_port, request):
    _, build, *_ = request.param
    d, outside = tmp_path / "cache", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    if build.__code__.co_argcount == 3:
        build(d, outside, monkeypatch)
    else:
        build(d, outside)
    anchor = d / "c.lynx"
    data = anchor.read_bytes()
    marker = b"{port}"
    if marker in data:  # the URL case: put the live port into the location and re-seal the header
        from lynxkv.stream.tier import relocate_residual

        loc = f"http://127.0.0.1:{http_port}/c.lynxr"
        anchor.write_bytes(relocate_residual(data, loc))
    return anchor, request.param


@pytest.mark.parametrize("hostile", CORPUS, ids=[case[0] for case in CORPUS], indirect=True)
def test_hostile_cache_gives_one_clean_error(hostile, capsys, http_port):
    anchor, (name, _, field, message) = hostile
    t0 = time.perf_counter()
    code, out, err = cli(capsys, "verify", anchor, "--json")
    assert code == 1, (out, err)
    findings = json.loads(out)["findings"]
    assert any(f["field"] == field and message in f["message"] for f in findings), findings
    code, _, err = cli(capsys, "decode", anchor, "-o", anchor.parent / "out.safetensors")
    assert code == 1 and message in one_error(err)
    assert not (anchor.parent / "out.safetensors").exists()
    code, out, err = cli(capsys, "inspect", anchor, "--json")
    if field in ("location", "page.raw_length") or field.endswith(("scale", "offset")):
        assert code == 0  # the header is fine: inspect shows it, the location recorded but not fetched
    else:
        assert code == 1 and one_error(err)
    assert SECRET.decode()[:20] not in out + err  # a foreign file's bytes are never echoed
    assert _CountingHandler.hits == []  # nothing was fetched from a URL the user did not allow
    assert time.perf_counter() - t0 < 30  # no hang (a FIFO is never opened for reading)


def test_inspect_shows_a_recorded_url_without_fetching_it(tmp_path, capsys, http_port):
    built = build_files(encode_kv(kv(), SCHEME), residual_location=f"http://127.0.0.1:{http_port}/c.lynxr")
    (tmp_path / "c.lynx").write_bytes(built.anchor)
    code, out, _ = cli(capsys, "inspect", tmp_path / "c.lynx")
    assert code == 0 and f"http://127.0.0.1:{http_port}/c.lynxr" in out and "not checked" in out
    assert _CountingHandler.hits == []
    code, out, _ = cli(capsys, "inspect", tmp_path / "c.lynx", "--check-residual", "--json",
                       "--allow-location", f"http://127.0.0.1:{http_port}/")
    assert code == 0 and json.loads(out)["residual_reachable"] is False and _CountingHandler.hits  # asked: fetched


def test_declared_shape_over_the_memory_limit_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    save_cache(tmp_path / "c.lynx", kv(), SCHEME)
    monkeypatch.setenv("LYNXKV_MAX_DECODED_BYTES", "1000")
    code, _, err = cli(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "o.safetensors")
    assert code == 1 and "more than the limit of 1,000 bytes" in one_error(err)
    monkeypatch.delenv("LYNXKV_MAX_DECODED_BYTES")
    assert cli(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "o.safetensors")[0] == 0


# -- stream -o: writes only inside the output's directory, replaces nothing without --force ------------------
def test_stream_copy_never_writes_outside_its_directory(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    built = build_files(encode_kv(kv(), SCHEME), residual_location="../../escaped/run.sh")
    (src / "c.lynx").write_bytes(built.anchor)
    (src / "c.lynxr").write_bytes(built.residual)
    victim = tmp_path / "escaped" / "run.sh"
    victim.parent.mkdir()
    victim.write_bytes(b"#!/bin/sh\necho keep me\n")
    dest = tmp_path / "dl" / "sub" / "copy.lynx"
    code, _, err = cli(capsys, "stream", src / "c.lynx", "--residual", src / "c.lynxr", "-o", dest)
    assert code == 1 and "outside the directory" in one_error(err)
    assert victim.read_bytes() == b"#!/bin/sh\necho keep me\n" and not dest.exists()


def test_stream_copy_replaces_only_with_force_and_atomically(tmp_path, capsys):
    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    dest = tmp_path / "dl" / "c.lynx"
    assert cli(capsys, "stream", tmp_path / "c.lynx", "-o", dest)[0] == 0
    before = dest.read_bytes()
    save_cache(tmp_path / "c.lynx", kv(2), SCHEME)
    code, _, err = cli(capsys, "stream", tmp_path / "c.lynx", "-o", dest)
    assert code == 1 and "--force" in one_error(err) and dest.read_bytes() == before
    assert cli(capsys, "stream", tmp_path / "c.lynx", "-o", dest, "--force")[0] == 0
    with open_cache(dest) as got, open_cache(tmp_path / "c.lynx") as want:
        assert got.verify() == [] and got.info.cache_id == want.info.cache_id
        assert all(torch.equal(a, b) for pa, pb in zip(got.load_kv(), want.load_kv()) for a, b in zip(pa, pb))
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted(["c.lynx", got.info.residual_location])


# -- replacing a two-file cache: a crash or a full disk at any point leaves the old or the new cache ---------
def _fails_on_call(n: int, exc: BaseException):
    """``AtomicWriter.commit`` that raises ``exc`` at its n-th call (a crash as the n-th file would be published)."""
    from lynxkv.storage import AtomicWriter

    real = AtomicWriter.commit
    calls = []

    def commit(self):
        calls.append(self.url)
        if len(calls) == n:
            raise exc
        return real(self)

    return commit


@pytest.mark.parametrize("fail_at", [1, 2], ids=["before-residual", "between-residual-and-anchor"])
def test_a_crash_while_replacing_leaves_the_old_cache(tmp_path, monkeypatch, fail_at):
    from lynxkv.storage import AtomicWriter

    path = tmp_path / "c.lynx"
    save_cache(path, kv(1), SCHEME)
    with open_cache(path) as cache:
        old = cache.load_kv()
    monkeypatch.setattr(AtomicWriter, "commit", _fails_on_call(fail_at, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save_cache(path, kv(2), SCHEME)
    monkeypatch.undo()
    assert verify_file(path) == []
    with open_cache(path) as cache:
        assert all(torch.equal(a, b) for pa, pb in zip(cache.load_kv(), old) for a, b in zip(pa, pb))
    save_cache(path, kv(3), SCHEME)  # the next run cleans up what the crash left
    with open_cache(path) as cache:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.lynx", cache.info.residual_location])


def test_disk_full_is_one_error_line_and_keeps_the_old_cache(tmp_path, capsys, monkeypatch):
    from safetensors.torch import save_file

    dump = tmp_path / "kv.safetensors"
    save_file({f"layers.{i}.{w}": t.contiguous() for i, pair in enumerate(kv(1)) for w, t in zip(("key", "value"),
                                                                                              pair)}, dump)
    assert cli(capsys, "encode", dump, "-o", tmp_path / "c.lynx")[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.glob("c.*")}

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    code, _, err = cli(capsys, "encode", dump, "-o", tmp_path / "c.lynx", "--force")
    monkeypatch.undo()
    assert code == 1 and "no space left" in one_error(err)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("c.*")} == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_disk_full_while_decoding_is_one_error_line(tmp_path, capsys, monkeypatch):
    save_cache(tmp_path / "c.lynx", kv(), SCHEME)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the output's bytes never reach the disk
    code, _, err = cli(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "o.safetensors")
    monkeypatch.undo()
    assert code == 1 and "no space left" in one_error(err)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_permission_denied_is_one_error_line(tmp_path, capsys, monkeypatch):
    save_cache(tmp_path / "c.lynx", kv(), SCHEME)
    real_open = os.open

    def denied(path, flags, *a, **k):
        if str(path).endswith(".tmp"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", denied)
    code, _, err = cli(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "o.safetensors")
    assert code == 1 and "permission denied" in one_error(err)


def test_written_files_get_the_umask_and_keep_a_replaced_files_mode(tmp_path):
    old = os.umask(0o027)
    try:
        save_cache(tmp_path / "c.lynx", kv(), SCHEME, single_file=True)
        assert (tmp_path / "c.lynx").stat().st_mode & 0o777 == 0o640
        os.chmod(tmp_path / "c.lynx", 0o604)
        save_cache(tmp_path / "c.lynx", kv(1), SCHEME, single_file=True)
        assert (tmp_path / "c.lynx").stat().st_mode & 0o777 == 0o604
    finally:
        os.umask(old)


def test_temporaries_of_killed_writers_are_cleaned_on_the_next_write(tmp_path):
    dead = tmp_path / ".c.lynx.999999999-0badcafe.tmp"  # no such process
    live = tmp_path / f".c.lynx.{os.getpid()}-0badcafe.tmp"  # a writer still at work
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    save_cache(tmp_path / "c.lynx", kv(), SCHEME, single_file=True)
    assert not dead.exists() and live.exists()


# -- tier: every page of every segment, sources deleted only after the destination verifies -----------------
def test_tier_refuses_a_single_file_whose_residual_section_is_corrupt(tmp_path, capsys):
    built = build_files(encode_kv(kv(), SCHEME), single_file=True)
    a = bytearray(built.anchor)
    a[-3] ^= 0x20  # a byte of the last residual page
    (tmp_path / "c.lynx").write_bytes(bytes(a))
    code, _, err = cli(capsys, "tier", tmp_path / "c.lynx", tmp_path / "warm" / "c.lynx")
    assert code == 1 and "page.crc32" in one_error(err)
    assert (tmp_path / "c.lynx").exists() and not (tmp_path / "warm" / "c.lynx").exists()


def test_tier_refuses_to_move_what_it_cannot_delete_before_writing(tmp_path, capsys, monkeypatch):
    import lynxkv.stream.tier as tier

    save_cache(tmp_path / "c.lynx", kv(), SCHEME)
    monkeypatch.setattr(tier, "can_remove", lambda url: False)  # e.g. an HTTP source
    code, _, err = cli(capsys, "tier", tmp_path / "c.lynx", "--residual-out", tmp_path / "cold" / "c.lynxr")
    assert code == 1 and "--keep" in one_error(err) and not (tmp_path / "cold").exists()


# -- fuzz: re-sealed headers reach every check behind the CRC -------------------------------------------------
def test_fuzz_resealed_headers_for_a_bounded_time(tmp_path):
    """For a few seconds: flip bytes inside the anchor header, re-seal its CRC, and read the result through
    verify and the cache API; only LynxError may come out, and nothing may take long."""
    rng = random.Random(99)
    enc = encode_kv(kv(3, tokens=13), SCHEME, names=["a", "b", "c", "d"], prompt_token_ids=[5, 6])
    bases = [build_files(enc, residual_location="c.lynxr"), build_files(enc, single_file=True, zstd=True)]
    deadline = time.perf_counter() + 3.0
    tried = 0
    while time.perf_counter() < deadline:
        built = rng.choice(bases)
        a = bytearray(built.anchor)
        length = struct.unpack_from("<I", a, 16)[0]
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(20, length - 4)  # past the prefix, so the header CRC is the only seal
            a[i] = rng.randrange(256)
        struct.pack_into("<I", a, length - 4, zlib.crc32(bytes(a[:length - 4])))
        t0 = time.perf_counter()
        try:
            verify_file(bytes(a), residual=built.residual)
            with open_cache(bytes(a), residual=built.residual) as cache:
                cache.load_kv()
        except LynxError:
            pass
        assert time.perf_counter() - t0 < 2.0
        tried += 1
    assert tried > 20


# -- hostile HTTP clients against `serve` ----------------------------------------------------------------------
def test_malformed_requests_get_a_400_and_log_one_line_each(tmp_path, capsys):
    """Garbage, a missing Host, a line or header past the limits: each peer gets a 400, the server keeps serving,
    and its log is one line per request (no traceback for a peer to fill the server's output with)."""
    import socket

    from lynxkv.serve import CacheServer, load_served_cache

    _write(tmp_path, build_files(encode_kv(kv(), SCHEME), residual_location="c.lynxr"))
    logged: list[str] = []
    bad = [b"GARBAGE\r\n\r\n", b"\x00\xff\xfe\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n",
           b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n"]
    with CacheServer(load_served_cache(str(tmp_path / "c.lynx")), log=logged.append) as srv:
        for request in bad:
            with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                s.sendall(request)
                status_line = s.recv(4096).split(b"\r\n", 1)[0]
                assert status_line.startswith(b"HTTP/1.") and b" 400 " in status_line, (request[:20], status_line)
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 200")
    _, err = capsys.readouterr()
    assert "Traceback" not in err and not any("Traceback" in m or "\n" in m for m in logged), (err, logged)
    assert any("Error handling request" in m for m in logged), logged  # reported, as one line


@pytest.mark.parametrize("field", ["key_scale", "value_offset", "value_scale"])
@pytest.mark.parametrize("anchor_only", [False, True])
def test_non_finite_metadata_of_values_per_channel_and_sinks_is_named(tmp_path, field, anchor_only):
    """Values per channel and sink tokens: a NaN in one page's metadata fails the load naming the
    field, the layer and the page, whole or anchor-only (the compiled pass flags it, the record decoder names it)."""
    scheme = Scheme(chunk=4, page=8, value_axis="channel", sink_tokens=2)
    enc = encode_kv(kv(), scheme)
    kind, part = field.split("_")
    # page 1 of layer 1: key chunk 2 (tokens 8-11) of channel 1, or token 9's one value group
    getattr(enc.layers[1][0 if kind == "key" else 1], part)[(0, 2, 1) if kind == "key" else (0, 9, 0)] = float("nan")
    _write(tmp_path, build_files(enc, residual_location="c.lynxr"))
    with open_cache(tmp_path / "c.lynx") as cache, pytest.raises(LynxError) as err:
        cache.load_kv(anchor_only=anchor_only)
    assert f"`{field}`" in str(err.value) and "layer 1 page 1" in str(err.value), str(err.value)


@pytest.mark.parametrize("how", ["tier-residual", "tier-anchor", "stream-o"])
def test_a_page_that_passes_its_crc_but_does_not_decode_is_not_copied(tmp_path, capsys, how):
    """A page whose CRC holds but whose record does not decode (a NaN scale, written by a hostile writer) is
    refused by tier and stream -o before anything is written: their check decodes every record."""
    enc = encode_kv(kv(), SCHEME)
    enc.layers[1][0].scale[0, 1, 2] = float("nan")
    _write(tmp_path, build_files(enc, residual_location="c.lynxr"))
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = {"tier-residual": ("tier", tmp_path / "c.lynx", "--residual-out", tmp_path / "cold" / "c.lynxr"),
            "tier-anchor": ("tier", tmp_path / "c.lynx", tmp_path / "warm" / "c.lynx", "--keep"),
            "stream-o": ("stream", tmp_path / "c.lynx", "-o", tmp_path / "got" / "c.lynx")}[how]
    code, out, err = cli(capsys, *argv)
    assert code == 1 and "NaN or infinity" in err.strip().splitlines()[-1], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == before
    assert not any(p.is_file() for d in ("cold", "warm", "got") if (tmp_path / d).exists()
                   for p in (tmp_path / d).iterdir())
