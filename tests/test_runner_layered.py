"""The layered verify (lynxkv.speculative.layered): the verify forward runs while the residual still arrives, each
layer once its own residual is in, and computes exactly what the verify on the whole full code computes."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from lynxkv.cache import open_cache, save_cache
from lynxkv.hf import prefill
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import ResidualUnavailable, RunConfig, Timing, decode_plain, run
from lynxkv.speculative import layered
from lynxkv.speculative.model_ops import first_step, forward_tokens, start_cache
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream import open_progressive
from runner_helpers import prompt_ids, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def _stored(tmp_path, arch: str, dtype=torch.float32, tokens: int = 200, seed: int = 3):
    model = make_tiny_model(arch, seed).to(dtype)
    ids = prompt_ids(seed, tokens)
    kv, _ = prefill(model, torch.tensor(ids))
    path = tmp_path / f"{arch}.lynx"
    save_cache(path, kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    with open_cache(path) as c:
        full_kv = c.load_kv()
    return model, ids, str(path), full_kv


def _bandwidth(path: str, seconds: float) -> float:
    """Bytes per second at which the whole cache (anchor + residual) takes about ``seconds``."""
    import os

    return (os.path.getsize(path) + os.path.getsize(path + "r")) / seconds


class _LongVerify(Timing):
    """This machine's figures as a run would see them if a verify took ages: the layered verify starts as early as
    it can (two draft steps in)."""

    def verify_estimate(self, rows, step, *, batch=False):
        return 1e4


@pytest.fixture
def eager():
    return _LongVerify()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_layered_forward_equals_the_forward_on_the_whole_full_code(tmp_path, dtype):
    model, ids, path, full_kv = _stored(tmp_path, "qwen2", dtype)
    keep, feed = first_step(ids, None)
    tokens = feed + [5, 9, 17, 2, 33]
    want = forward_tokens(model, start_cache(model, full_kv, keep), tokens)
    with open_progressive(path, link=link_at(_bandwidth(path, 1.5))) as load:
        anchor_kv = load.wait_anchor(30)
        cache = start_cache(model, anchor_kv, keep)
        layers = layered.decoder_layers(model, cache)
        assert layers is not None and len(layers) == model.config.num_hidden_layers
        lv = layered.LayeredVerify(load, cache, layers, keep, model.dtype, model.device)
        assert not load.residual.done()  # the forward starts before the residual is in
        with lv.installed():
            got = forward_tokens(model, cache, tokens)
        assert lv.waited_s > 0.1  # it waited for layers to land
    assert torch.equal(got, want)
    for layer, (k, v) in zip(cache.layers, full_kv):  # the cache now holds the full code, then the new tokens
        assert torch.equal(layer.keys[0, :, :keep], k[:, :keep].to(dtype))
        assert torch.equal(layer.values[0, :, :keep], v[:, :keep].to(dtype))
    assert not model.model.layers[0]._forward_pre_hooks  # the hooks are gone


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_a_run_verifies_layer_by_layer_and_equals_decoding_on_the_full_code(tmp_path, arch, eager):
    model, ids, path, full_kv = _stored(tmp_path, arch)
    with open_progressive(path, link=link_at(_bandwidth(path, 1.0))) as load:
        result = run(model, load, RunConfig(max_new_tokens=24), timing=eager)
    s = result.stats
    assert s.verify_layered and s.drafted > 0 and s.verified
    assert s.verify_start_s < s.residual_ready_s <= s.verify_end_s  # it started before the last layer was in
    assert s.verify_waited_s > 0
    assert result.token_ids == decode_plain(model, full_kv, ids, 24, first_forward=s.draft_token_ids)


def test_a_load_with_room_is_grown_into_in_place_with_the_same_tokens(tmp_path, eager):
    model, ids, path, full_kv = _stored(tmp_path, "llama")
    keep = len(ids) - 1
    with open_cache(path) as c:
        anchor0 = c.load_kv(anchor_only=True, dtype=torch.float32)
    with open_progressive(path, link=link_at(_bandwidth(path, 1.0)), room=32) as load:
        assert load.grow_in_place
        result = run(model, load, RunConfig(max_new_tokens=24), timing=eager)
        anchor, full = load.wait_anchor(), load.residual.result()
    s = result.stats
    assert s.verified and s.verify_layered and s.drafted > 0
    assert result.token_ids == decode_plain(model, full_kv, ids, 24, first_forward=s.draft_token_ids)
    # The draft cache grew into the anchor's buffers and the verify cache into the full code's: the cached prompt's
    # last token, fed again, was written over its stored row in place; the rows before it are the stored ones.
    assert not torch.equal(anchor[0][0][:, keep], anchor0[0][0][:, keep])
    assert not torch.equal(full[0][0][:, keep], full_kv[0][0][:, keep])
    for (k, v), (k0, v0) in zip(anchor + full, anchor0 + full_kv):
        assert torch.equal(k[:, :keep], k0[:, :keep]) and torch.equal(v[:, :keep], v0[:, :keep])


def _corrupt_last_layer(path: str) -> None:
    """Flip a byte near the end of the residual file: inside the last layer's last page record."""
    data = bytearray(open(path + "r", "rb").read())
    data[-64] ^= 0xFF
    open(path + "r", "wb").write(bytes(data))


def test_a_residual_layer_that_fails_during_the_layered_verify_ends_the_run_clearly(tmp_path, eager):
    model, ids, path, _ = _stored(tmp_path, "llama")
    _corrupt_last_layer(path)
    with open_progressive(path, link=link_at(_bandwidth(path, 0.8))) as load:
        with pytest.raises(ResidualUnavailable, match="residual failed.*anchor-only"):
            run(model, load, RunConfig(max_new_tokens=16), timing=eager)


def test_with_anchor_only_allowed_a_failed_layer_falls_back_to_the_anchor(tmp_path, eager):
    model, ids, path, _ = _stored(tmp_path, "llama")
    with open_cache(path) as c:
        anchor_kv = c.load_kv(anchor_only=True)
    _corrupt_last_layer(path)
    with open_progressive(path, link=link_at(_bandwidth(path, 0.8)), allow_anchor_only=True) as load:
        result = run(model, load, RunConfig(max_new_tokens=16, allow_anchor_only=True), timing=eager)
    s = result.stats
    assert s.verify_layered and not s.verified and "residual failed" in s.residual_error
    assert result.token_ids == decode_plain(model, anchor_kv, ids, 16)


def test_without_drafts_the_first_forward_waits_for_the_whole_residual(tmp_path):
    # drafting would not pay (a decode step is known to take a second, the residual due within a few of them): the
    # run waits for the full code, and so does the monolithic baseline (no speculation)
    model, ids, path, full_kv = _stored(tmp_path, "llama")
    for options in ({}, {"speculate": False}):
        with open_progressive(path, link=link_at(_bandwidth(path, 1.0))) as load:
            result = run(model, load, RunConfig(max_new_tokens=12, **options), timing=Timing(1.0, len(ids)))
        s = result.stats
        assert s.drafted == 0 and not s.verify_layered and s.verify_start_s >= s.residual_ready_s
        assert result.token_ids == decode_plain(model, full_kv, ids, 12)


def test_a_window_drafted_before_the_residual_is_verified_layer_by_layer(tmp_path):
    model, ids, path, full_kv = _stored(tmp_path, "llama")
    with open_progressive(path, link=link_at(_bandwidth(path, 1.5))) as load:
        result = run(model, load, RunConfig(max_new_tokens=12, max_window=3))
    s = result.stats
    assert s.drafted == 3 and s.verify_layered and s.verify_start_s < s.residual_ready_s <= s.verify_end_s
    assert result.token_ids == decode_plain(model, full_kv, ids, 12, first_forward=s.draft_token_ids)


def test_lynxkv_run_verifies_layer_by_layer(tmp_path, capsys):
    import json

    from lynxkv.cli import main
    from runner_helpers import tiny_llama_cache

    _, model_dir, path, _, _ = tiny_llama_cache(tmp_path)
    code = main(["run", path, "--model", model_dir, "-n", "20", "--ignore-eos", "--max-window", "4", "--bandwidth",
                 f"{_bandwidth(path, 1.0):.0f}B/s", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    stats = json.loads(out.out)["stats"]
    assert stats["drafted"] == 4 and stats["verify_layered"] and stats["verify_start_s"] < stats["residual_ready_s"]
