"""lynxkv's attention (lynxkv.hf.attention): a masked multi-token forward of a grouped-query model on the CPU runs
SDPA's grouped-query mode instead of copying the key and value heads, and gives stock SDPA's logits bit for bit."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from conftest import TINY_ARCHS, make_tiny_model
from lynxkv.hf import prefill
from lynxkv.hf.attention import IMPL, use_grouped_sdpa
from lynxkv.hf.convert import kv_to_cache
from lynxkv.hf.prefill import _cache_argument
from lynxkv.speculative.model_ops import drop_last
from runner_helpers import prompt_ids

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(model, kv, dtype, ids) -> list[torch.Tensor]:
    """A verify-like forward of 9 tokens after the cache (minus its last token), then one single-token step:
    every row of logits, through the model's own call (not lynxkv's forward, which would switch it)."""
    cache = kv_to_cache(kv, dtype=dtype)
    drop_last(cache, 1)
    arg = _cache_argument(type(model))
    out = []
    with torch.no_grad():
        for tokens in ([ids[-1], 3, 8, 21, 5, 9, 40, 2, 17], [11]):
            x = torch.tensor([tokens])
            out.append(model(input_ids=x, use_cache=True, **{arg: cache}).logits[0])
    return out


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_grouped_sdpa_gives_stock_sdpas_logits_bit_for_bit(arch, dtype, monkeypatch):
    stock = make_tiny_model(arch, 3).to(dtype)
    ours = make_tiny_model(arch, 3).to(dtype)
    ids = prompt_ids(3, 90)
    kv, _ = prefill(stock, torch.tensor(ids))  # lynxkv's forward: switches ``stock`` too, where it runs SDPA
    sdpa = stock.config._attn_implementation in ("sdpa", IMPL)
    stock.config._attn_implementation = "sdpa" if sdpa else stock.config._attn_implementation
    use_grouped_sdpa(ours)
    assert (ours.config._attn_implementation == IMPL) == sdpa
    copies = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda h, n: copies.append(n) or real(h, n))
    want = _rows(stock, kv, dtype, ids)
    copied_by_stock = len(copies)
    copies.clear()
    got = _rows(ours, kv, dtype, ids)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    if sdpa:  # every layer of the 9-token forward copied its heads in stock SDPA; none does here
        assert copied_by_stock == 2 * stock.config.num_hidden_layers and copies == []


def test_a_model_without_sdpa_is_left_as_it_is():
    model = make_tiny_model("llama", 0)
    model.config._attn_implementation = "eager"
    use_grouped_sdpa(model)
    assert model.config._attn_implementation == "eager"
