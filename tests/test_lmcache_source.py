"""The lmcache:// source without LMCache: joining stored chunk caches into one (lynxkv.stream.joined), the URL,
and the error when the extra is missing. The reads from a real LMCache store are in tests/test_lmcache.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import lynxkv
from lynxkv.cache import open_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.reader import PageReader
from lynxkv.storage import BytesSource, open_source
from lynxkv.stream import open_progressive
from lynxkv.stream.joined import join_caches, read_part
from lynxkv.integrations.lmcache.source import parse_address

LAYERS, HEADS, DIM = 3, 2, 16
SCHEME = lynxkv.DEFAULT.replace(sink_tokens=0)  # only a joined cache's start may hold sinks: chunks have none


def _kv(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(HEADS, tokens, DIM, generator=g), torch.randn(HEADS, tokens, DIM, generator=g))
            for _ in range(LAYERS)]


def _save_chunks(tmp_path, kv, sizes, scheme=SCHEME):
    parts, t0 = [], 0
    for i, n in enumerate(sizes):
        path = str(tmp_path / f"chunk{i}.lynx")
        lynxkv.save_cache(path, [(k[:, t0:t0 + n], v[:, t0:t0 + n]) for k, v in kv], scheme)
        parts.append(read_part(path))
        t0 += n
    return parts


def test_joined_chunks_are_the_cache_saved_whole(tmp_path):
    kv = _kv(3 * 256 + 100)
    parts = _save_chunks(tmp_path, kv, [256, 256, 256, 100])  # the last part may end inside a page
    ids = list(range(3 * 256 + 100))
    joined = join_caches(parts, prompt_token_ids=ids, properties={"lynxkv.model": "org/m"},
                         residual_location="joined.lynxr")
    anchor = joined.anchor.fetch(0, joined.anchor.size)
    residual = joined.residual.fetch(0, joined.residual.size)
    assert len(joined.anchor.spans) == LAYERS * 4 and len(anchor) == joined.anchor.size
    assert verify_file(anchor, residual=residual) == []
    lynxkv.save_cache(tmp_path / "whole.lynx", kv, SCHEME)
    with open_cache(anchor, residual=residual) as j, open_cache(tmp_path / "whole.lynx") as w:
        assert j.header.tokens == w.header.tokens and list(j.header.prompt_token_ids) == ids
        assert j.info.properties == {"lynxkv.model": "org/m"}
        for anchor_only in (True, False):
            for (jk, jv), (wk, wv) in zip(j.load_kv(anchor_only=anchor_only), w.load_kv(anchor_only=anchor_only)):
                assert torch.equal(jk, wk) and torch.equal(jv, wv)
    jr, wr = PageReader(BytesSource(anchor)), PageReader(open_source(str(tmp_path / "whole.lynx")))
    jr.attach_residual(BytesSource(residual))
    wr.attach_residual(open_source(str(tmp_path / "whole.lynxr")))
    for layer in range(LAYERS):
        for page in range(4):  # every page byte for byte the whole cache's
            for kind in (c.SEGMENT_ANCHOR, c.SEGMENT_RESIDUAL):
                assert jr.stored(kind, layer, page) == wr.stored(kind, layer, page)
    # a range read across parts gives the same bytes as the whole segment
    assert joined.anchor.fetch(1000, 9000) == anchor[1000:9000]


def test_parts_that_do_not_join_are_refused(tmp_path):
    kv = _kv(512)
    a, b = _save_chunks(tmp_path, kv, [100, 412])
    with pytest.raises(InputError, match="ends inside a page"):
        join_caches([a, b], residual_location="x.lynxr")
    (tmp_path / "l").mkdir()
    c1, = _save_chunks(tmp_path, kv, [256])
    c2, = _save_chunks(tmp_path / "l", _kv(256, 1), [256], scheme=lynxkv.get_scheme("linear"))
    with pytest.raises(InputError, match="scheme"):
        join_caches([c1, c2], residual_location="x.lynxr")
    (tmp_path / "r").mkdir()  # the same scheme but for the key rotation
    r2, = _save_chunks(tmp_path / "r", _kv(256, 1), [256], scheme=SCHEME.replace(key_rotation="none"))
    with pytest.raises(InputError, match="scheme"):
        join_caches([c1, r2], residual_location="x.lynxr")
    (tmp_path / "s").mkdir()
    s1, s2 = _save_chunks(tmp_path / "s", kv, [256, 256], scheme=lynxkv.DEFAULT)  # 4 sink tokens in each
    with pytest.raises(InputError, match="sink tokens"):
        join_caches([s1, s2], residual_location="x.lynxr")


def test_the_lmcache_url():
    a = parse_address("lmcache://org%2Fm?anchor_path=/fast/lynx&tokens=1,2,3&residual_path=s3://b/r&salt=u1")
    assert (a.model, a.anchor_path, a.tokens, a.residual_path, a.salt) == ("org/m", "/fast/lynx", (1, 2, 3),
                                                                        "s3://b/r", "u1")
    assert parse_address("lmcache:///tmp/vl/model?tokens=7&anchor_path=d").model == "/tmp/vl/model"
    for bad, why in [("lmcache://m?tokens=1", "anchor_path= is required"),
                     ("lmcache://m?anchor_path=d", "tokens= is required"),
                     ("lmcache://m?anchor_path=d&tokens=1,x", "token ids must be integers"),
                     ("lmcache://m?anchor_path=d&tokens=1&host=h", "unknown parameter 'host'"),
                     ("lmcache://m?anchor_path=d&tokens=1&tokens=2", "tokens given twice"),
                     ("lmcache://m?anchor_path=d&tokens=1&world_size=2&rank=2", "rank must be"),
                     ("lmcache://?anchor_path=d&tokens=1", "model name")]:
        with pytest.raises(InputError, match=why):
            parse_address(bad)


def test_token_ids_from_a_file(tmp_path):
    (tmp_path / "ids.json").write_text("[5, 6,\n7]")
    assert parse_address(f"lmcache://m?anchor_path=d&tokens=@{tmp_path}/ids.json").tokens == (5, 6, 7)


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="LMCache is installed here")
def test_without_the_extra_an_lmcache_source_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(InputError, match=r'pip install "lynxkv\[lmcache\]"'):
        open_progressive(f"lmcache://org/m?anchor_path={tmp_path}&tokens=1,2,3")
    assert main(["stream", f"lmcache://org/m?anchor_path={tmp_path}&tokens=1,2,3"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lynxkv: error:") and 'pip install "lynxkv[lmcache]"' in lines[0]
