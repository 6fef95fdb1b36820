"""The attention lynxkv's forwards run: ``transformers``' SDPA attention, except that a masked multi-token forward
of a grouped-query model on the CPU (a verify pass, new prompt text after a cache, a teacher-forced score) lets
SDPA share each key and value head among its query heads (``enable_gqa``) instead of copying every head
``num_key_value_groups`` times first (``repeat_kv``), which ``transformers`` does whenever a mask is given.

At 3,000 cached tokens of SmolLM2 (9 query heads over 3 KV heads) that copy writes 14 MB a layer and 415 MB a
forward: without it a verify pass of 40–45 drafts took 18% less time on a 2-core CPU (docs/speculative.md, "The
verify pass").
The rows are the same, bit for bit, as with the copy: in fp32, bf16 and fp16, with boolean and additive masks
(``tests/test_hf_attention.py`` checks the logits of whole models of the test matrix against stock SDPA). One-token
steps, forwards without a mask, models without grouped heads and other devices take ``transformers``' own path.
"""

from __future__ import annotations

import threading

import torch

#: the name under which the attention is registered with ``transformers`` (attention and mask interfaces)
IMPL = "lynxkv_sdpa"

_LOCK = threading.Lock()
_registered = False


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """``transformers``' SDPA attention function (same arguments, output ``[B, q, heads, D]``), with the case in
    the module docstring computed by SDPA's grouped-query mode."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and attention_mask is not None
            and query.device.type == "cpu" and key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_grouped_sdpa(model) -> None:
    """Run ``model``'s attention through :func:`grouped_sdpa` where it uses SDPA (idempotent; other
    implementations, e.g. eager for a model with soft-capping, are left as they are)."""
    global _registered
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    with _LOCK:
        if not _registered:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(IMPL, grouped_sdpa)
            AttentionMaskInterface.register(IMPL, sdpa_mask)  # the masks SDPA's are
            _registered = True
        config._attn_implementation = IMPL
