"""Inputs of an evaluation: built-in prompts (with held-out text after them) and safetensors KV dumps."""

from __future__ import annotations

import torch

from lynxkv.errors import InputError
from lynxkv.dumps import load_kv_safetensors
from lynxkv.kv import KVPairs
from lynxkv.hf.prompts import QUESTION, builtin_prompt, document

#: Distance between the corpus sections that start two prompts of the same length (a prime, so successive
#: prompts start on unrelated topics of the ~90 sorted pydoc topics).
PROMPT_STRIDE = 17


def prompt_starts(count: int, offset: int = 0) -> list[int]:
    """Corpus sections where the ``count`` prompts of one length start (``offset`` shifts them all)."""
    return [offset + i * PROMPT_STRIDE for i in range(count)]


def builtin_case(tokenizer, tokens: int, start: int, heldout: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt ids ``[T]`` of about ``tokens`` tokens, and the next ``heldout`` tokens of the same document.

    The prompt is :func:`lynxkv.hf.prompts.builtin_prompt` (documentation + a question); the held-out text is the
    documentation that continues after the part the prompt kept, which the model has not seen.
    """
    prompt = builtin_prompt(tokenizer, tokens, start=start)
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    if ids.numel() < 2:
        raise InputError(f"--tokens {tokens}: the prompt is too short")
    if heldout <= 0:
        return ids, None
    budget = max(tokens - len(tokenizer(QUESTION).input_ids), 1)
    doc_ids = tokenizer(document(start, min_chars=(tokens + heldout) * 6 + 2000)).input_ids
    held = torch.tensor(doc_ids[budget : budget + heldout], dtype=torch.long)
    return ids, (held if held.numel() else None)


Case = tuple[torch.Tensor, "torch.Tensor | None"]  # (prompt ids [T], held-out ids [N] or None)

#: Modules of CPython's standard library whose source is the held-out reporting corpus (``--corpus stdlib``):
#: code, not the English documentation the built-in prompts (the choosing corpus) are cut from.
STDLIB_MODULES = ("argparse", "inspect", "typing", "dataclasses", "functools", "pathlib", "subprocess", "tarfile",
                  "zipfile", "email/message", "json/decoder", "asyncio/base_events")


def stdlib_text() -> str:
    """The held-out corpus: the source of :data:`STDLIB_MODULES`, concatenated in that order (several hundred
    thousand tokens; read from this interpreter's standard library)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InputError(f"--corpus stdlib: cannot read {path} ({exc}); give --text FILE instead") from None
    return "\n\n".join(parts)


def text_cases(tokenizer, text: str, tokens: int, count: int, heldout: int) -> list[Case]:
    """Up to ``count`` (prompt ids ``[tokens]``, held-out ids ``[heldout]``) pairs cut one after the other from a
    user's ``text``: prompt i is tokens ``[i·(tokens+heldout), i·(tokens+heldout) + tokens)``, its held-out text the
    ``heldout`` tokens after it."""
    ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
    stride = tokens + heldout
    n = min(count, ids.numel() // stride)
    if n == 0:
        raise InputError(
            f"--text: the text has {ids.numel()} tokens, fewer than one prompt of {tokens} plus {heldout} held-out"
        )
    cases = []
    for i in range(n):
        start = i * stride
        held = ids[start + tokens : start + stride] if heldout else None
        cases.append((ids[start : start + tokens], held))
    return cases


def load_kv_dump(path: str) -> KVPairs:
    """Per-layer (keys, values) ``[H, T, D]`` in fp32 from a safetensors KV dump (the naming conventions of
    :mod:`lynxkv.dumps`: ``layers.{i}.key`` / ``past_key_values.{i}.value``, ``[H, T, D]`` or ``[1, H, T, D]``).
    Safetensors only: nothing on this path can execute code."""
    kv, _ = load_kv_safetensors(path)
    if kv[0][0].shape[1] == 0:
        raise InputError(f"{path}: the KV tensors hold no tokens")
    out = []
    for i, (k, v) in enumerate(kv):
        k, v = k.float(), v.float()
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            raise InputError(f"{path}: layer {i} holds inf or NaN values")
        out.append((k, v))
    return out
