"""GrowingLayer: a cache layer that appends in place gives the DynamicLayer's logits bit for bit, never writes the
tensors it was given, and copies only the new tokens on a step."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from lynxkv.hf import prefill
from lynxkv.hf.convert import kv_to_cache
from lynxkv.hf.growing import GrowingLayer, fork_cache, grow_in_place
from lynxkv.speculative.model_ops import drop_last, forward_tokens, start_cache
from runner_helpers import prompt_ids


def _steps(model, cache, ids):
    """A verify-like forward of 4 tokens, 2 of them dropped, then 5 greedy steps: every row of logits."""
    rows = [forward_tokens(model, cache, [ids[-1], 3, 8, 21])]
    drop_last(cache, 2)
    token = int(rows[0][-3].argmax())
    for _ in range(5):
        rows.append(forward_tokens(model, cache, [token]))
        token = int(rows[-1][-1].argmax())
    return rows


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_growing_layers_give_the_dynamic_layers_logits_bit_for_bit(arch, dtype):
    model = make_tiny_model(arch, 2).to(dtype)
    ids = prompt_ids(2, 90)
    kv, _ = prefill(model, torch.tensor(ids))
    given = [(k.clone(), v.clone()) for k, v in kv]

    def cache():
        c = kv_to_cache(kv, dtype=dtype)
        drop_last(c, 1)
        return c

    want = _steps(model, cache(), ids)
    grown = grow_in_place(cache())
    assert all(isinstance(layer, GrowingLayer) for layer in grown.layers)
    got = _steps(model, grown, ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, given))  # never written


def test_a_step_writes_in_place_until_the_room_is_used_up():
    layer = GrowingLayer(room=4)
    first = torch.randn(1, 2, 10, 8)
    layer.update(first, first)
    buffer = layer.keys.data_ptr()
    for i in range(4):
        step = torch.full((1, 2, 1, 8), float(i))
        k, _ = layer.update(step, step)
        assert k.data_ptr() == buffer and k.shape[-2] == 11 + i  # in place
    assert torch.equal(layer.keys[..., :10, :], first) and torch.equal(layer.keys[..., 13, :], step[..., 0, :])
    layer.crop(-2)  # drop two tokens; the next one lands where they were
    layer.update(step + 1, step + 1)
    assert layer.keys.shape[-2] == 13 and layer.keys.data_ptr() == buffer
    assert torch.equal(layer.keys[..., 12, :], step[..., 0, :] + 1)
    layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))  # past the room: a bigger buffer, same tokens
    assert layer.keys.data_ptr() != buffer and layer.keys.shape[-2] == 16
    assert torch.equal(layer.keys[..., :10, :], first)


def _with_room(x: torch.Tensor, room: int) -> torch.Tensor:
    """``x`` ([H, T, D]) copied to the front of a buffer of T + room tokens a head, the room filled with NaN."""
    h, t, d = x.shape
    buf = torch.full((h, t + room, d), float("nan"), dtype=x.dtype)
    buf[:, :t].copy_(x)
    return buf[:, :t]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_an_adopting_cache_grows_into_the_room_of_the_tensors_it_was_given(arch):
    model = make_tiny_model(arch, 2)
    ids = prompt_ids(2, 90)
    kv, _ = prefill(model, torch.tensor(ids))
    keep, room = len(ids) - 1, 16
    roomy = [(_with_room(k, room), _with_room(v, room)) for k, v in kv]
    want = _steps(model, start_cache(model, kv, keep), ids)
    cache = start_cache(model, roomy, keep, adopt=True)
    got = _steps(model, cache, ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    grown = [(layer, k, v) for layer, (k, v) in zip(cache.layers, roomy) if isinstance(layer, GrowingLayer)]
    assert grown  # (a sliding-window layer keeps its own kind)
    for layer, k, v in grown:  # the cache's tokens are the given buffer's: nothing was copied
        assert layer.keys.data_ptr() == k.data_ptr() and layer.values.data_ptr() == v.data_ptr()
        assert not torch.isnan(layer.keys).any()  # the new tokens landed in the room
    for (k, v), (k0, v0) in zip(roomy, kv):  # the tokens the cache kept are the given ones, untouched
        assert torch.equal(k[:, :keep], k0[:, :keep]) and torch.equal(v[:, :keep], v0[:, :keep])


def test_without_room_or_without_adopting_the_first_step_copies():
    model = make_tiny_model("llama", 2)
    ids = prompt_ids(2, 40)
    kv, _ = prefill(model, torch.tensor(ids))
    keep = len(ids) - 1
    for given, adopt in (([(k.clone(), v.clone()) for k, v in kv], True),  # no room to grow into
                         ([(_with_room(k, 8), _with_room(v, 8)) for k, v in kv], False),  # room, not adopted
                         ([(_with_room(k, 1), _with_room(v, 1)) for k, v in kv], True)):  # too little room
        before = [(k.clone(), v.clone()) for k, v in given]
        cache = start_cache(model, given, keep, adopt=adopt)
        forward_tokens(model, cache, [ids[-1], 4, 5])
        assert all(layer.keys.data_ptr() != k.data_ptr() for layer, (k, _) in zip(cache.layers, given))
        assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(given, before))


def test_a_fork_of_an_adopting_cache_never_writes_into_its_buffer():
    model = make_tiny_model("llama", 2)
    ids = prompt_ids(2, 40)
    kv, _ = prefill(model, torch.tensor(ids))
    keep = len(ids) - 1
    roomy = [(_with_room(k, 32), _with_room(v, 32)) for k, v in kv]
    cache = start_cache(model, roomy, keep, adopt=True)
    forward_tokens(model, cache, [ids[-1], 4])
    mine = [layer.keys[0].clone() for layer in cache.layers]
    fork = fork_cache(cache)
    forward_tokens(model, fork, [7, 8, 9])
    assert all(f.keys.data_ptr() != k.data_ptr() for f, (k, _) in zip(fork.layers, roomy))
    forward_tokens(model, cache, [6])  # the main chain goes on where it was, over its own tokens
    assert all(torch.equal(layer.keys[0, :, :-1], m) for layer, m in zip(cache.layers, mine))
