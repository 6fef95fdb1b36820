"""Shared helpers for the runner tests: tiny-model caches, a load whose residual lands after exactly k drafts."""

from __future__ import annotations

import concurrent.futures

import torch

from lynxkv.cache.loading import CacheLoad, LoadTimeline
from lynxkv.hf import prefill
from lynxkv.hf.models import model_fingerprint
from lynxkv.quant.scheme import get_scheme
from lynxkv.bench.simulated import split_kv


def prompt_ids(seed: int, length: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def caches(model, ids: list[int], *, scheme: str = "default", **overrides):
    """(exact KV, anchor-only KV, full-code KV) of ``ids`` under ``model``."""
    kv, _ = prefill(model, torch.tensor(ids))
    anchor_kv, full_kv = split_kv(kv, get_scheme(scheme, **overrides))
    return kv, anchor_kv, full_kv


def perturbed(kv, scale: float, seed: int = 0):
    """``kv`` plus Gaussian noise of ``scale`` times each tensor's std: a very coarse 'anchor'."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, v in kv:
        out.append(tuple(x + scale * x.std() * torch.randn(x.shape, generator=g) for x in (k, v)))
    return out


class _OnDemand(concurrent.futures.Future):
    """A future that is not done until someone asks for its result: the residual 'lands' exactly when the
    runner stops drafting (at its window cap), with no wall-clock dependence."""

    def __init__(self, value=None, error=None):
        super().__init__()
        self._value, self._error = value, error

    def result(self, timeout=None):
        if not self.done():
            if self._error is not None:
                self.set_exception(self._error)
            else:
                self.set_result(self._value)
        return super().result(timeout)


class StepLoad(CacheLoad):
    """A CacheLoad whose anchor is ready at once and whose residual arrives after the window cap is drafted."""

    def __init__(self, model, ids, anchor_kv, full_kv, *, error=None, fingerprint=None):
        self.prompt_token_ids = list(ids)
        self.model_fingerprint = fingerprint or model_fingerprint(model)
        self._anchor = anchor_kv
        self._future = _OnDemand(full_kv, error)
        self._timeline = LoadTimeline()

    def wait_anchor(self, timeout=None):
        return self._anchor

    @property
    def residual(self):
        return self._future

    def residual_eta(self):
        return None

    @property
    def timeline(self):
        return self._timeline

    def close(self):
        pass


def single_thread():
    """Tiny models run fastest on one intra-op thread (two threads on a shared 2-core box mostly spin)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def word(i: int) -> str:
    """The word of token ``i`` (< 676) in :func:`save_tiny_model_dir` 's tokenizer: ``w`` and two letters (no
    digits, no word a prefix of another: some transformers tokenizer classes split such words)."""
    return "w" + chr(ord("a") + i // 26) + chr(ord("a") + i % 26)


def text_of(ids) -> str:
    return " ".join(word(i) for i in ids)


def save_tiny_model_dir(model, path) -> str:
    """Save ``model`` with a word-level tokenizer (token i is the word :func:`word` (i)) so ``load_model(path)``
    and the CLI's ``--model PATH`` can load it like any Hugging Face model directory."""
    import json
    import os

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(model.config.vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token=word(0)))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=word(0), eos_token=word(1))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    # transformers 5 picks a model type's own tokenizer class (Qwen2's byte-level BPE) unless told otherwise
    config = os.path.join(path, "tokenizer_config.json")
    with open(config) as f:
        settings = json.load(f)
    with open(config, "w") as f:
        json.dump({**settings, "tokenizer_class": "TokenizersBackend"}, f)
    return str(path)


def store_prefill(model, ids: list[int], path: str):
    """Prefill ``ids`` with ``model``, store the cache at ``path`` (with its prompt and the model's fingerprint) and
    return its full code as every reader decodes it."""
    from lynxkv.cache import open_cache, save_cache

    kv, _ = prefill(model, torch.tensor(ids))
    save_cache(path, kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    with open_cache(path) as c:
        return c.load_kv()


def tiny_llama_cache(directory, seed: int = 4, tokens: int = 300):
    """A 3-layer tiny Llama saved as a Hugging Face directory under ``directory`` and its prefill of a
    ``tokens``-long prompt stored as ``directory/c.lynx``: (model, model dir, cache path, prompt ids, exact KV)."""
    from conftest import make_tiny_llama
    from lynxkv.cache import save_cache

    model = make_tiny_llama(seed, layers=3, head_dim=32)
    model_dir = save_tiny_model_dir(model, directory / "model")
    ids = prompt_ids(seed, tokens)
    kv, _ = prefill(model, torch.tensor(ids))
    path = directory / "c.lynx"
    save_cache(path, kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    return model, model_dir, str(path), ids, kv
