"""``lynxkv stream`` and ``lynxkv tier`` as a user runs them: JSON keys, exit codes, one-line errors."""

from __future__ import annotations

import json
import os

import pytest
from unittest.mock import ANY
from fixtures_s3 import cache_bytes, random_kv, write_pair

from lynxkv.cli import main


@pytest.fixture()
def cache(tmp_path):
    anchor, residual = cache_bytes(random_kv(layers=2, heads=2, tokens=300, dim=16))
    return write_pair(tmp_path, anchor, residual), anchor, residual


def test_stream_json_timeline(cache, capsys):
    path, anchor, residual = cache
    assert main(["stream", path, "--bandwidth", "100Mbps", "--latency", "1ms", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("anchor_ready_s", "residual_ready_s", "anchor_bytes", "residual_bytes", "anchor_rate",
                "residual_rate", "total_rate", "monolithic"):
        assert key in out
    assert out["anchor_bytes"] == len(anchor) and out["residual_bytes"] == len(residual)
    assert out["anchor_ready_s"] < out["residual_ready_s"] and not out["anchor_only"]
    bf16 = out["monolithic"]["bf16"]
    assert bf16["bytes"] == 2 * 2 * 2 * 300 * 16 * 2
    assert bf16["seconds"] == pytest.approx(bf16["bytes"] / out["total_rate"] + 0.001)


def test_stream_table_and_copy(cache, tmp_path, capsys):
    path, anchor, residual = cache
    dest = tmp_path / "copy" / "c.lynx"
    assert main(["stream", path, "-o", str(dest)]) == 0
    text = capsys.readouterr().out
    assert "anchor" in text and "BF16" in text and "INT4" in text
    assert dest.read_bytes() == anchor and (tmp_path / "copy" / "x.lynxr").read_bytes() == residual


def test_stream_missing_residual_fails_or_goes_anchor_only(cache, tmp_path, capsys):
    path, _, _ = cache
    os.unlink(os.path.join(os.path.dirname(path), "x.lynxr"))
    dest = tmp_path / "out" / "a.lynx"
    assert main(["stream", path, "-o", str(dest)]) == 1
    assert "no such file" in capsys.readouterr().err and not dest.exists()
    assert main(["stream", path, "--allow-anchor-only", "--json", "-o", str(dest)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["anchor_only"] and "no such file" in out["residual_failed"] and out["residual_ready_s"] is None
    assert "anchor only (lossy)" in captured.err
    assert dest.exists()  # the anchor alone was kept, flagged


def test_stream_corrupt_anchor_fails_even_when_anchor_only_is_allowed(cache, capsys):
    path, anchor, _ = cache
    bad = bytearray(anchor)
    bad[-3] ^= 1
    open(path, "wb").write(bytes(bad))
    assert main(["stream", path, "--allow-anchor-only"]) == 1
    err = capsys.readouterr().err
    assert "page.crc32" in err and "Traceback" not in err


@pytest.mark.parametrize("args,match", [
    (["stream", "PATH", "--bandwidth", "fast"], "bandwidth"),
    (["stream", "PATH", "--latency", "soon"], "duration"),
    (["tier", "PATH"], "nothing to do"),
    (["serve", "PATH", "--dscp-anchor", "XX1"], "DSCP"),
], ids=["bandwidth", "latency", "tier-nothing", "dscp"])
def test_bad_options_are_one_line_errors(cache, args, match, capsys):
    path, _, _ = cache
    assert main([a if a != "PATH" else path for a in args]) == 1
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_tier_copy_keeps_the_source(cache, tmp_path, capsys):
    path, anchor, residual = cache
    dest = str(tmp_path / "warm" / "x.lynx")
    assert main(["tier", path, dest, "--keep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert os.path.exists(path)
    assert out["residual_location"] == os.path.relpath(os.path.join(os.path.dirname(path), "x.lynxr"),
                                                       os.path.dirname(dest))
    from lynxkv.cache import verify_file
    from lynxkv.format import Finding

    assert verify_file(dest) == [Finding("residual", "location", ANY)]  # ../x.lynxr: outside, not followed
    assert verify_file(dest, allow_locations=[os.path.dirname(path)]) == []


def test_single_file_cache_copies_from_disk_and_over_http(tmp_path, capsys):
    from lynxkv.serve import CacheServer, load_served_cache

    anchor, _ = cache_bytes(random_kv(layers=2, heads=2, tokens=300, dim=16), single_file=True)
    src = write_pair(tmp_path, anchor, None, name="one")
    disk = tmp_path / "disk" / "one.lynx"
    assert main(["stream", src, "-o", str(disk)]) == 0
    assert disk.read_bytes() == anchor
    capsys.readouterr()
    with CacheServer(load_served_cache(src)) as srv:
        wire = tmp_path / "wire" / "one.lynx"
        assert main(["stream", srv.url, "-o", str(wire), "--json"]) == 0
    assert wire.read_bytes() == anchor
    out = json.loads(capsys.readouterr().out)
    assert out["anchor_bytes"] + out["residual_bytes"] == len(anchor) and out["residual_ready_s"] is not None
