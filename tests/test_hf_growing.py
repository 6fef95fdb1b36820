"""GrowingLayer: a cache layer that appends in place gives the DynamicLayer's logits bit for bit, never writes the
tensors it was given, and copies only the new tokens on a step."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from lynxkv.hf import prefill
from lynxkv.hf.convert import kv_to_cache
from lynxkv.hf.growing import GrowingLayer, grow_in_place
from lynxkv.speculative.model_ops import drop_last, forward_tokens
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
