"""transformers caches both ways: a ``DynamicCache`` goes into ``save_cache`` as it is, and ``to_dynamic_cache``
gives back one that ``model.generate(past_key_values=...)`` accepts (full code or anchor only)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from conftest import make_tiny_model
from lynxkv import InputError, open_cache, save_cache
from lynxkv.hf import cache_to_kv, kv_to_cache, prefill, to_dynamic_cache
from runner_helpers import prompt_ids

N = 6


def _generate(model, ids: list[int], past) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), cache=past, max_new_tokens=N, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def model(request):
    return make_tiny_model(request.param)


def _dynamic_cache(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def test_dynamic_cache_round_trip_gives_identical_generate_output(model):
    ids = prompt_ids(1, 50)
    original = _dynamic_cache(model, ids)
    back = kv_to_cache(cache_to_kv(original))
    question = prompt_ids(2, 4)
    assert _generate(model, ids + question, back) == _generate(model, ids + question, copy.deepcopy(original))


def test_save_cache_takes_a_dynamic_cache(model, tmp_path):
    ids = prompt_ids(3, 40)
    dc = _dynamic_cache(model, ids)
    save_cache(tmp_path / "a.lynx", dc, prompt_token_ids=ids)
    save_cache(tmp_path / "b.lynx", cache_to_kv(dc), prompt_token_ids=ids)
    with open_cache(tmp_path / "a.lynx") as a, open_cache(tmp_path / "b.lynx") as b:
        assert a.info.tokens == 40 and a.info.prompt_token_ids == ids
        for (ka, va), (kb, vb) in zip(a.load_kv(), b.load_kv()):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("anchor_only", [False, True])
def test_generate_accepts_the_opened_cache(model, tmp_path, anchor_only):
    """``generate`` on the opened cache gives what it gives on the decoded tensors themselves (a question after
    the cached document; and the cached prompt itself, cropped by one token: generate needs an uncached input).
    generate is compared with generate: its forwards round a little differently from a plain loop of
    ``model(...)`` calls (up to 5e-3 in the logits of a tiny fp32 Llama), enough to flip a near-tie."""
    ids, question = prompt_ids(4, 48), prompt_ids(5, 3)
    kv, _ = prefill(model, torch.tensor(ids))
    save_cache(tmp_path / "x.lynx", kv, prompt_token_ids=ids)
    with open_cache(tmp_path / "x.lynx") as cache:
        stored = cache.load_kv(anchor_only=anchor_only)
        got = _generate(model, ids + question, to_dynamic_cache(cache, model, anchor_only=anchor_only))
        past = to_dynamic_cache(cache, model, anchor_only=anchor_only)
    assert got == _generate(model, ids + question, kv_to_cache(stored))
    past.crop(-1)
    reference = kv_to_cache(stored)
    reference.crop(-1)
    assert _generate(model, ids, past) == _generate(model, ids, reference)


def test_to_dynamic_cache_converts_to_the_model_dtype(tmp_path):
    model = make_tiny_model("qwen2").to(torch.bfloat16)
    ids = prompt_ids(6, 30)
    kv, _ = prefill(model.float(), torch.tensor(ids))
    model.to(torch.bfloat16)
    save_cache(tmp_path / "x.lynx", kv, prompt_token_ids=ids)  # stored fp32, computed in bf16
    with open_cache(tmp_path / "x.lynx") as cache:
        assert cache.info.dtype == "fp32"
        past = to_dynamic_cache(cache, model)
    assert past.layers[0].keys.dtype == torch.bfloat16
    assert len(_generate(model, ids + [3], past)) == N


def test_sliding_window_cache_that_dropped_tokens_is_refused(tmp_path):
    from transformers import DynamicCache

    model = make_tiny_model("mistral")  # sliding window 16
    ids = prompt_ids(7, 40)
    dc = DynamicCache(config=model.config)  # transformers' own sliding layers keep only window - 1 tokens
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=dc, use_cache=True)
    with pytest.raises(InputError, match="sliding-window layer .window 16. that keeps only the last 15 of 40"):
        save_cache(tmp_path / "x.lynx", dc, prompt_token_ids=ids)
    assert os.listdir(tmp_path) == []


def test_batch_of_two_is_refused(tmp_path):
    k = torch.zeros(2, 2, 5, 16)
    with pytest.raises(InputError, match="batch 2; lynxkv stores one sequence per cache"):
        save_cache(tmp_path / "x.lynx", kv_to_cache_batched(k))
    assert os.listdir(tmp_path) == []


def kv_to_cache_batched(k):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k, k)])


class _PastKeyValuesModel(torch.nn.Module):
    """A model whose forward names its cache ``past_key_values`` (transformers < 5.20), and swallows other
    keywords as those models' ``**kwargs`` do."""

    def forward(self, input_ids, past_key_values=None, use_cache=False, **kwargs):
        from types import SimpleNamespace

        k = torch.ones(1, 1, input_ids.shape[1], 2)
        past_key_values.update(k, k, 0)
        return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 3))


def test_forward_passes_the_cache_under_either_argument_name(model):
    from transformers import DynamicCache

    from lynxkv.hf import forward

    old, cache = _PastKeyValuesModel(), DynamicCache()
    forward(old, torch.tensor([[1, 2, 3]]), cache)
    assert cache.get_seq_length() == 3  # a `cache=` keyword would have been swallowed and the cache left empty
    ids = prompt_ids(model.config.vocab_size, 5)
    kv, _ = prefill(model, torch.tensor(ids))
    assert kv[0][0].shape[1] == 5


def test_kv_to_cache_shares_the_tensors_and_never_writes_them(model):
    """No copy when dtype and device match (each layer is a view of the given tensor), and a generate over the
    cache (appends) and a crop leave the given tensors as they were; the output is that of the copied cache."""
    from transformers import DynamicCache

    ids = prompt_ids(3, 12)
    kv = cache_to_kv(_dynamic_cache(model, ids[:-1]))  # [H, T, D] each
    before = [(k.clone(), v.clone()) for k, v in kv]
    cache = kv_to_cache(kv)
    for layer, (k, v) in zip(cache.layers, kv):
        assert layer.keys.data_ptr() == k.data_ptr() and layer.values.data_ptr() == v.data_ptr()
    copied = DynamicCache(ddp_cache_data=[(k.unsqueeze(0).clone(), v.unsqueeze(0).clone()) for k, v in kv])
    assert _generate(model, ids, cache) == _generate(model, ids, copied)
    cache.crop(-5)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, before))


def test_kv_to_cache_copies_where_reset_would_zero_the_tensors(model, monkeypatch):
    """A transformers whose DynamicLayer.reset zeroes its tensors in place (releases before it dropped them): the
    cache gets copies, and a reset leaves the given tensors alone."""
    from transformers.cache_utils import CacheLayerMixin, DynamicLayer

    from lynxkv.hf import convert

    monkeypatch.setattr(DynamicLayer, "reset", CacheLayerMixin.reset)
    monkeypatch.setattr(convert, "_layers_leave_their_tensors_alone",
                        convert._layers_leave_their_tensors_alone.__wrapped__)
    kv = cache_to_kv(_dynamic_cache(model, prompt_ids(4, 10)))
    cache = kv_to_cache(kv)
    assert all(layer.keys.data_ptr() != k.data_ptr() for layer, (k, _) in zip(cache.layers, kv))
    cache.reset()
    assert all(bool(k.abs().sum() > 0) for k, _ in kv)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_a_prefill_in_chunks_gives_the_cache_and_logits_of_one_forward(arch, chunk):
    """Each chunk attends to the cache of the ones before it (sliding windows shorter than the prompt included):
    the cache and the last logits of one forward, up to rounding, and exactly one forward at or above the
    prompt's length."""
    model = make_tiny_model(arch)
    ids = torch.tensor(prompt_ids(3, 40))
    whole, last = prefill(model, ids, chunk=None)
    kv, logits = prefill(model, ids, chunk=chunk)
    exact = chunk >= ids.numel()
    for (k, v), (wk, wv) in zip(kv, whole, strict=True):
        for got, want in ((k, wk), (v, wv)):
            assert got.shape == want.shape
            assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(logits, last) if exact else torch.allclose(logits, last, atol=1e-4, rtol=1e-4)
    with pytest.raises(InputError, match="chunk"):
        prefill(model, ids, chunk=0)
