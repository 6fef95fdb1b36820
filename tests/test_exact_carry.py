"""The exact segment everywhere the other segments go: ``lynxkv tier --exact-out``, ``lynxkv serve``,
the progressive reader's third stage (``open_progressive(..., exact=True)``, ``lynxkv stream --exact``) and
``stream -o``: bit-identical tensors in every dtype, and a wrong, corrupt or untrusted exact segment refused with
one clear error before any tensor is returned or any file written."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from lynxkv.cache import open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import LynxError
from lynxkv.format import constants as c
from lynxkv.serve import CacheServer, load_served_cache
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream import open_progressive
from lynxkv.stream.tier import move_cache

from exact_helpers import DTYPES, exact_kv, same_bits

_kv = functools.partial(exact_kv, layers=2, d=32)  # smaller than the format tests' default


def _exact_of(path, **kw):
    with open_cache(path, **kw) as cache:
        return cache.load_kv(exact=True)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    """The one ``lynxkv: error:`` line, the last on stderr (progress bars may come before it), no traceback."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("lynxkv: error:"), err
    return errors[0]


# -- tier ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tier_moves_the_exact_segment_and_the_anchor_names_it(tmp_path, capsys, dtype):
    kv = _kv(DTYPES[dtype])
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    code, out, _ = run(capsys, "tier", tmp_path / "c.lynx", "--exact-out", tmp_path / "cold" / "c.lynxe", "--json")
    result = json.loads(out)
    assert code == 0 and result["exact_location"] == "cold/c.lynxe" and "exact" in result["moved"]
    assert not (tmp_path / "c.lynxe").exists() and (tmp_path / "cold" / "c.lynxe").exists()
    with open_cache(tmp_path / "c.lynx") as cache:
        assert cache.info.exact_location == "cold/c.lynxe"
    assert same_bits(_exact_of(tmp_path / "c.lynx"), kv)
    assert verify_file(tmp_path / "c.lynx") == []
    # the anchor moves to another directory: the exact location it records follows, and still resolves
    (tmp_path / "warm").mkdir()
    code, out, _ = run(capsys, "tier", tmp_path / "c.lynx", tmp_path / "warm" / "d.lynx", "--json",
                       "--allow-location", tmp_path)
    assert code == 0 and json.loads(out)["exact_location"] == "../cold/c.lynxe"
    assert not (tmp_path / "c.lynx").exists()
    assert same_bits(_exact_of(tmp_path / "warm" / "d.lynx", allow_locations=[str(tmp_path)]), kv)


def test_tier_refuses_a_corrupt_or_foreign_exact_segment_and_changes_nothing(tmp_path, capsys):
    kv = _kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "a.lynx", kv, exact=True)
    save_cache(tmp_path / "b.lynx", kv, exact=True)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    data = bytearray(before["a.lynxe"])
    data[-1] ^= 0x40
    (tmp_path / "a.lynxe").write_bytes(data)
    code, _, err = run(capsys, "tier", tmp_path / "a.lynx", "--exact-out", tmp_path / "cold" / "a.lynxe")
    assert code == 1 and "crc" in one_error_line(err).lower()
    assert not (tmp_path / "cold" / "a.lynxe").exists() and (tmp_path / "a.lynx").read_bytes() == before["a.lynx"]
    shutil.copy(tmp_path / "b.lynxe", tmp_path / "a.lynxe")  # another cache's exact file under a's name
    code, _, err = run(capsys, "tier", tmp_path / "a.lynx", "--exact-out", tmp_path / "cold" / "a.lynxe")
    assert code == 1 and "another cache" in one_error_line(err)
    assert not (tmp_path / "cold" / "a.lynxe").exists() and (tmp_path / "a.lynx").read_bytes() == before["a.lynx"]
    save_cache(tmp_path / "s.lynx", kv, exact=True, single_file=True)
    code, _, err = run(capsys, "tier", tmp_path / "s.lynx", "--exact-out", tmp_path / "s.lynxe")
    assert code == 1 and "inside the anchor file" in one_error_line(err)


def test_a_full_disk_on_the_anchor_removes_the_exact_copy_no_anchor_names(tmp_path, monkeypatch):
    import lynxkv.stream.tier as tier

    kv = _kv(torch.float16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    before = (tmp_path / "c.lynx").read_bytes()
    real = tier.write_atomic

    def full_for_anchors(url, data, **kw):
        if str(url).endswith(".lynx"):
            raise LynxError(f"{url}: no space left on the device; nothing was written")
        return real(url, data, **kw)

    monkeypatch.setattr(tier, "write_atomic", full_for_anchors)
    with pytest.raises(LynxError, match="no space"):
        move_cache(str(tmp_path / "c.lynx"), exact_to=str(tmp_path / "far" / "c.lynxe"))
    assert not (tmp_path / "far" / "c.lynxe").exists()
    assert (tmp_path / "c.lynx").read_bytes() == before and same_bits(_exact_of(tmp_path / "c.lynx"), kv)


@pytest.mark.parametrize("kill_at", ["exact", "anchor"])
def test_a_killed_move_never_leaves_an_anchor_naming_a_missing_exact_file(tmp_path, kill_at):
    """A move killed after the exact copy is published (before the anchor names it), or after the anchor is
    rewritten (before the old exact file is removed): the anchor names a file that exists, and the next writer of
    the path removes the one no anchor names."""
    import lynxkv.stream.tier as tier

    kv = _kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    pid = os.fork()
    if pid == 0:  # the child: killed (os._exit, no cleanup) right after the chosen file is published
        real = tier.write_atomic

        def write_then_die(url, data, **kw):
            real(url, data, **kw)
            if str(url).endswith(".lynxe" if kill_at == "exact" else ".lynx"):
                os._exit(9)

        tier.write_atomic = write_then_die
        try:
            move_cache(str(tmp_path / "c.lynx"), exact_to=str(tmp_path / "cold" / "c.lynxe"))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    named = "c.lynxe" if kill_at == "exact" else "cold/c.lynxe"
    with open_cache(tmp_path / "c.lynx") as cache:
        assert cache.info.exact_location == named
    assert (tmp_path / "c.lynxe").exists() and (tmp_path / "cold" / "c.lynxe").exists()  # both, for now
    assert same_bits(_exact_of(tmp_path / "c.lynx"), kv)
    save_cache(tmp_path / "c.lynx", kv, exact=True)  # the next writer of the path settles the journal
    with open_cache(tmp_path / "c.lynx") as cache:
        now = cache.info.exact_location
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.lynxe"))
    assert left == [now], left  # the dead move's copy or source, which no anchor named, is gone
    assert same_bits(_exact_of(tmp_path / "c.lynx"), kv)


# -- the progressive reader's exact stage ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("single_file", [False, True], ids=["two-files", "single-file"])
def test_progressive_load_reads_anchor_then_full_then_exact(tmp_path, dtype, single_file):
    kv = _kv(DTYPES[dtype])
    save_cache(tmp_path / "c.lynx", kv, exact=True, single_file=single_file)
    with open_cache(tmp_path / "c.lynx") as cache:
        full = cache.load_kv()
    for bandwidth in (None, "400Mbps"):  # read in place, and pumped through an emulated link
        events = []
        with open_progressive(str(tmp_path / "c.lynx"), exact=True, link=link_at(bandwidth),
                              on_event=events.append) as load:
            exact = load.exact.result(timeout=60)
            assert same_bits(exact, kv)
            assert same_bits(load.residual.result(), full)  # the full code stays what it was (a copy was rebuilt)
            assert not same_bits(full, kv)
            tl = load.timeline
            assert tl.anchor_ready_s <= tl.residual_ready_s <= tl.extra["exact_ready_s"]
            kinds = [e.kind for e in events]
            assert kinds.index("anchor_ready") < kinds.index("residual_ready") < kinds.index("exact_ready")
            if bandwidth:  # strict priority on the link: the exact segment's first byte after the residual's last
                link = tl.extra["link"]
                assert link["exact"]["bytes"] == tl.extra["exact_total_bytes"]
                assert link["exact"]["first_s"] >= link["residual"]["last_s"] - tl.extra["link"]["latency_s"] - 1e-3


def test_progressive_exact_refusals_are_one_clear_error_and_leave_the_full_code(tmp_path):
    kv = _kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "a.lynx", kv, exact=True)
    save_cache(tmp_path / "b.lynx", kv, exact=True)
    save_cache(tmp_path / "n.lynx", kv)
    with open_progressive(str(tmp_path / "n.lynx"), exact=True) as load:  # no exact segment
        with pytest.raises(LynxError, match="no exact segment"):
            load.exact.result(timeout=60)
        assert load.residual.result() is not None
    with open_progressive(str(tmp_path / "n.lynx"), exact=None) as load:  # only where there is one
        assert load.exact.result(timeout=60) is None
    with open_progressive(str(tmp_path / "a.lynx"), exact_file=str(tmp_path / "b.lynxe")) as load:
        with pytest.raises(LynxError, match="another cache"):
            load.exact.result(timeout=60)
    with open_progressive(str(tmp_path / "a.lynx"), exact=True, dtype=torch.float32) as load:
        with pytest.raises(LynxError, match="original dtype"):
            load.exact.result(timeout=60)
    data = bytearray((tmp_path / "a.lynxe").read_bytes())
    data[-1] ^= 0x01
    (tmp_path / "a.lynxe").write_bytes(data)
    for bandwidth in (None, "1Gbps"):
        with open_progressive(str(tmp_path / "a.lynx"), exact=True, link=link_at(bandwidth)) as load:
            with pytest.raises(LynxError, match="(?i)crc"):
                load.exact.result(timeout=60)
            assert load.residual.result() is not None and "exact_ready_s" not in load.timeline.extra


def test_progressive_exact_follows_the_trust_rule(tmp_path):
    kv = _kv(torch.float16, layers=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "elsewhere").mkdir()
    save_cache(tmp_path / "a" / "c.lynx", kv, exact_path=tmp_path / "elsewhere" / "c.lynxe")
    with open_progressive(str(tmp_path / "a" / "c.lynx"), exact=True) as load:
        with pytest.raises(LynxError, match="outside the anchor's directory"):
            load.exact.result(timeout=60)
    with open_progressive(str(tmp_path / "a" / "c.lynx"), exact=True,
                          allow_locations=[str(tmp_path / "elsewhere")]) as load:
        assert same_bits(load.exact.result(timeout=60), kv)


def test_a_failed_load_ends_the_exact_stage_at_once_with_its_error(tmp_path):
    """``lynxkv stream --exact`` (decode=False) reads exact pages as they come; once the load has failed the exact
    stage cannot succeed, so it ends then with the load's error and the events end, instead of waiting for exact
    bytes that may never come (behind an emulated link they wait for a residual nobody reads any more)."""
    import threading

    kv = _kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    (tmp_path / "c.lynxr").unlink()  # the residual is gone: the load fails (no anchor-only leave)
    release = threading.Event()

    def hook(segment, fetch):
        if segment != "exact":
            return fetch

        def held(a, b):  # exact bytes that do not come while the test runs
            release.wait(60)
            return fetch(a, b)
        return held

    events = []
    try:
        with open_progressive(str(tmp_path / "c.lynx"), exact=True, decode=False, fetch_hook=hook,
                              on_event=events.append) as load:
            with pytest.raises(LynxError, match="c.lynxr") as failed:
                load.exact.result(timeout=5)
            with pytest.raises(LynxError):
                list(load.events(timeout=5))  # the events end (then the load's error is raised)
            assert failed.value is load.residual.exception()
            assert [e.kind for e in events][-2:] == ["error", "exact_failed"]
    finally:
        release.set()


# -- serve, stream, stream -o ----------------------------------------------------------------------------------
@pytest.mark.network
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_serve_then_progressive_exact_over_http_is_bit_identical(tmp_path, dtype):
    kv = _kv(DTYPES[dtype])
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    served = load_served_cache(str(tmp_path / "c.lynx"))
    assert served.exact is not None and served.exact.path == "c.lynxe" and not served.relocated
    with CacheServer(served, bandwidth=50e6) as srv:
        assert srv.describe()["exact"]["size"] == (tmp_path / "c.lynxe").stat().st_size
        with open_progressive(srv.url, exact=True) as load:
            assert same_bits(load.exact.result(timeout=60), kv)
            assert load.exact_url.endswith("/c.lynxe")
        order = [r["resource"] for r in srv.stats.requests if r["status"] == 206]
        assert order.index("exact") > max(i for i, r in enumerate(order) if r == "anchor")
        assert verify_file(srv.url) == []  # ranged reads of every segment, the exactness check included
        assert same_bits(_exact_of(srv.url), kv)  # open_cache(url).load_kv(exact=True)


@pytest.mark.network
def test_stream_copies_the_exact_segment_and_verifies_it(tmp_path, capsys):
    kv = _kv(torch.bfloat16)
    (tmp_path / "src").mkdir()
    save_cache(tmp_path / "src" / "c.lynx", kv, exact=True)
    with CacheServer(load_served_cache(str(tmp_path / "src" / "c.lynx"))) as srv:
        code, out, _ = run(capsys, "stream", srv.url, "--exact", "--json")
        report = json.loads(out)
        assert code == 0 and report["exact_bytes"] == (tmp_path / "src" / "c.lynxe").stat().st_size
        assert report["exact_ready_s"] >= report["residual_ready_s"]
        dest = tmp_path / "got" / "c.lynx"
        code, out, _ = run(capsys, "stream", srv.url, "-o", dest, "--json")  # -o copies it without --exact
        assert code == 0 and json.loads(out)["exact_bytes"] > 0
    for name in ("c.lynx", "c.lynxr", "c.lynxe"):
        assert (tmp_path / "got" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    assert verify_file(dest) == [] and same_bits(_exact_of(dest), kv)
    # a single file copies its inline exact segment with it; --exact-out puts a two-file copy's elsewhere
    save_cache(tmp_path / "s.lynx", kv, exact=True, single_file=True)
    assert run(capsys, "stream", tmp_path / "s.lynx", "-o", tmp_path / "got" / "s.lynx", "--bandwidth", "1Gbps")[0] == 0
    assert (tmp_path / "got" / "s.lynx").read_bytes() == (tmp_path / "s.lynx").read_bytes()
    code, _, _ = run(capsys, "stream", tmp_path / "src" / "c.lynx", "-o", tmp_path / "two" / "c.lynx",
                     "--exact-out", tmp_path / "two" / "cold" / "c.lynxe", "--bandwidth", "1Gbps")
    assert code == 0 and (tmp_path / "two" / "cold" / "c.lynxe").exists()
    assert same_bits(_exact_of(tmp_path / "two" / "c.lynx"), kv)


@pytest.mark.network
def test_serve_and_stream_refuse_a_corrupt_or_untrusted_exact_segment(tmp_path, capsys):
    kv = _kv(torch.float32, layers=1)
    save_cache(tmp_path / "a.lynx", kv, exact=True)
    save_cache(tmp_path / "b.lynx", kv, exact=True)
    good = (tmp_path / "a.lynxe").read_bytes()
    data = bytearray(good)
    data[-1] ^= 0x10
    (tmp_path / "a.lynxe").write_bytes(data)
    code, _, err = run(capsys, "serve", tmp_path / "a.lynx", "--port", "0", "--once")
    assert code == 1 and "refusing to serve" in one_error_line(err)
    code, out, err = run(capsys, "stream", tmp_path / "a.lynx", "-o", tmp_path / "got" / "a.lynx",
                         "--bandwidth", "1Gbps")
    assert code == 1 and out == "" and "crc" in one_error_line(err).lower()
    assert not (tmp_path / "got").exists() or not any((tmp_path / "got").iterdir())
    code, _, err = run(capsys, "serve", tmp_path / "a.lynx", "--exact-file", tmp_path / "b.lynxe", "--port", "0")
    assert code == 1 and "another cache" in one_error_line(err)
    # an exact file recorded outside the anchor's directory is served only when the user names or allows it
    (tmp_path / "sub").mkdir()
    (tmp_path / "d").mkdir()
    save_cache(tmp_path / "d" / "c.lynx", kv, exact_path=tmp_path / "sub" / "c.lynxe")
    served = load_served_cache(str(tmp_path / "d" / "c.lynx"))  # served without it; a client asking is refused
    assert served.exact is None and "outside the anchor's directory" in served.exact_skipped
    with CacheServer(served) as srv:
        with open_progressive(srv.url, exact=True) as load:
            with pytest.raises(LynxError, match="outside the anchor's directory"):
                load.exact.result(timeout=60)
            assert load.residual.result() is not None
        assert all(r["resource"] != "exact" for r in srv.stats.requests)
    served = load_served_cache(str(tmp_path / "d" / "c.lynx"), allow=[str(tmp_path / "sub")])
    assert served.exact.path == "c.lynxe" and served.relocated
    with CacheServer(served) as srv:
        with open_progressive(srv.url, exact=True) as load:
            assert same_bits(load.exact.result(timeout=60), kv)


def test_tier_moves_the_exact_segment_to_an_object_store_and_back(tmp_path, capsys):
    """Any fsspec URL is a tier (``memory://`` stands in for S3 here): the anchor records the URL, which a reader
    follows only where allowed; the progressive reader streams the exact segment from it."""
    kv = _kv(torch.bfloat16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    url = "memory://archive-27/c.lynxe"
    code, out, _ = run(capsys, "tier", tmp_path / "c.lynx", "--exact-out", url, "--json")
    assert code == 0 and json.loads(out)["exact_location"] == url and not (tmp_path / "c.lynxe").exists()
    with pytest.raises(LynxError, match="outside the anchor's directory"):
        _exact_of(tmp_path / "c.lynx")
    assert same_bits(_exact_of(tmp_path / "c.lynx", allow_locations=["memory://archive-27/"]), kv)
    with open_progressive(str(tmp_path / "c.lynx"), exact=True, allow_locations=["memory://archive-27/"]) as load:
        assert same_bits(load.exact.result(timeout=60), kv) and load.exact_url == url
    code, out, _ = run(capsys, "tier", tmp_path / "c.lynx", "--exact-out", tmp_path / "c.lynxe", "--json",
                       "--allow-location", "memory://archive-27/")
    assert code == 0 and json.loads(out)["exact_location"] == "c.lynxe"
    assert same_bits(_exact_of(tmp_path / "c.lynx"), kv)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_progressive_exact_only_where_there_is_one_decodes_in_the_cache_dtype(tmp_path, dtype):
    """``exact=None`` reads the exact segment of a cache that has one exactly as ``exact=True`` does (the full code
    in the cache's own dtype, so that the exact pages apply to it), and leaves a cache without one in fp32."""
    kv = _kv(DTYPES[dtype], layers=1)
    save_cache(tmp_path / "e.lynx", kv, exact=True)
    save_cache(tmp_path / "n.lynx", kv)
    with open_progressive(str(tmp_path / "e.lynx"), exact=None) as load:
        assert same_bits(load.exact.result(timeout=60), kv)
        assert load.residual.result()[0][0].dtype == DTYPES[dtype]
    with open_progressive(str(tmp_path / "n.lynx"), exact=None) as load:
        assert load.exact.result(timeout=60) is None
        assert load.residual.result()[0][0].dtype == torch.float32


def test_a_failed_read_back_of_the_rewritten_anchor_keeps_the_exact_copy_it_names(tmp_path, monkeypatch):
    """The anchor was published naming the exact segment's copy, and only reading it back failed (a flaky store):
    the copy it names stays, so the anchor never names a missing exact file."""
    import lynxkv.stream.tier as tier

    kv = _kv(torch.float16, layers=1)
    save_cache(tmp_path / "c.lynx", kv, exact=True)
    real, reads = tier.read_range, []

    def flaky_anchor_reads(url, start, end, *a, **kw):
        if str(url).endswith(".lynx"):
            reads.append(url)
            if len(reads) == 2:  # the first read is the move's own; the second reads the published anchor back
                raise LynxError(f"{url}: connection reset")
        return real(url, start, end, *a, **kw)

    monkeypatch.setattr(tier, "read_range", flaky_anchor_reads)
    with pytest.raises(LynxError, match="connection reset"):
        move_cache(str(tmp_path / "c.lynx"), exact_to=str(tmp_path / "cold" / "c.lynxe"))
    monkeypatch.undo()
    with open_cache(tmp_path / "c.lynx") as cache:
        named = cache.info.exact_location
    assert (tmp_path / named).exists(), named
    assert verify_file(tmp_path / "c.lynx") == [] and same_bits(_exact_of(tmp_path / "c.lynx"), kv)


def test_an_exact_segment_outside_the_anchor_directory_names_the_exact_options(tmp_path, capsys):
    """The error names the options that name the exact segment (--exact-file, --exact-out), never the residual's:
    following the hint must not point lynxkv at the residual instead."""
    kv = _kv(torch.float16, layers=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "elsewhere").mkdir()
    save_cache(tmp_path / "a" / "c.lynx", kv, exact_path=tmp_path / "elsewhere" / "c.lynxe")
    code, _, err = run(capsys, "stream", tmp_path / "a" / "c.lynx", "--exact")
    line = one_error_line(err)
    assert code == 1 and "--exact-file" in line and "--residual" not in line, line
    code, _, err = run(capsys, "stream", tmp_path / "a" / "c.lynx", "-o", tmp_path / "o" / "c.lynx",
                       "--allow-location", tmp_path / "elsewhere")
    line = one_error_line(err)
    assert code == 1 and "--exact-out" in line and "--residual" not in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    code, _, err = run(capsys, "stream", tmp_path / "a" / "c.lynx", "-o", tmp_path / "o" / "c.lynx",
                       "--allow-location", tmp_path / "elsewhere", "--exact-out", tmp_path / "o" / "c.lynxe")
    assert code == 0 and same_bits(_exact_of(tmp_path / "o" / "c.lynx"), kv)


def test_serve_says_once_how_to_name_an_exact_file_it_leaves_out(tmp_path):
    kv = _kv(torch.float16, layers=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "elsewhere").mkdir()
    save_cache(tmp_path / "a" / "c.lynx", kv, exact_path=tmp_path / "elsewhere" / "c.lynxe")
    skipped = load_served_cache(str(tmp_path / "a" / "c.lynx")).exact_skipped
    assert skipped.count("--exact-file") == 1 and "--residual" not in skipped, skipped
