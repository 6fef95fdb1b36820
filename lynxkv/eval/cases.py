"""Inputs of an evaluation: the two corpora prompts are cut from, and safetensors KV dumps.

A model is scored on two corpora that share no text (:data:`OVERLAP_TOKENS`):

- the **choosing** corpus, the built-in prompts (pydoc's English documentation and a question): the text
  schemes are tuned and chosen on;
- the **held-out** corpus, text that had no part in choosing: by default the source of a dozen
  standard-library modules (:func:`stdlib_text`), or any text files the user names.

Each prompt comes with its text's own continuation (the next tokens), for the perplexity change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynxkv.errors import InputError
from lynxkv.cache.dumps import load_kv_safetensors
from lynxkv.cache.kv import KVPairs
from lynxkv.hf.prompts import QUESTION, builtin_prompt, corpus_sections, document

#: Distance between the corpus sections that start two prompts of the same length (a prime, so successive
#: prompts start on unrelated topics of the 79 sorted pydoc topics).
PROMPT_STRIDE = 17

Case = tuple[torch.Tensor, "torch.Tensor | None"]  # (prompt ids [T], continuation ids [N] or None)


@dataclass(frozen=True)
class Corpus:
    """Text an evaluation cuts prompts from, and its role."""

    role: str  # "choosing" (the text schemes are chosen on) or "heldout" (the text they are reported on)
    name: str  # what the text is, for titles
    text: str | None = None  # None: the built-in prompts


CHOOSING = Corpus("choosing", "built-in prompts (pydoc topics)")


def prompt_starts(count: int) -> list[int]:
    """Corpus sections where the ``count`` built-in prompts of one length start."""
    return [i * PROMPT_STRIDE for i in range(count)]


def builtin_case(tokenizer, tokens: int, start: int, continuation: int) -> Case:
    """Prompt ids ``[T]`` of about ``tokens`` tokens, and the next ``continuation`` tokens of the same document.

    The prompt is :func:`lynxkv.hf.prompts.builtin_prompt` (documentation + a question); the continuation is the
    documentation that follows the part the prompt kept, which the model has not seen.
    """
    prompt = builtin_prompt(tokenizer, tokens, start=start)
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    if ids.numel() < 2:
        raise InputError(f"--tokens {tokens}: the prompt is too short")
    if continuation <= 0:
        return ids, None
    budget = max(tokens - len(tokenizer(QUESTION).input_ids), 1)
    doc_ids = tokenizer(document(start, min_chars=(tokens + continuation) * 6 + 2000)).input_ids
    held = torch.tensor(doc_ids[budget : budget + continuation], dtype=torch.long)
    return ids, (held if held.numel() else None)


#: Modules of CPython's standard library whose source is the default held-out corpus: code, not the English
#: documentation the built-in prompts (the choosing corpus) are cut from.
STDLIB_MODULES = ("argparse", "inspect", "typing", "dataclasses", "functools", "pathlib", "subprocess", "tarfile",
                  "zipfile", "email/message", "json/decoder", "asyncio/base_events")

#: Two pieces of text overlap when they share a run of this many consecutive tokens. Held-out prompts share no
#: such run with the choosing corpus nor with each other (shorter common runs are idioms, not shared text).
OVERLAP_TOKENS = 32


def stdlib_text() -> str:
    """The default held-out corpus: the source of :data:`STDLIB_MODULES`, concatenated in that order (about 220K
    SmolLM2 tokens; read from this interpreter's standard library)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InputError(f"held-out corpus: cannot read {path} ({exc}); give --heldout-text FILE instead") from None
    return "\n\n".join(parts)


def token_runs(ids: list[int], n: int = OVERLAP_TOKENS) -> set[int]:
    """Hashes of every run of ``n`` consecutive tokens of ``ids`` (a piece shorter than ``n``: the whole piece)."""
    if len(ids) < n:
        return {hash(tuple(ids))} if ids else set()
    return {hash(tuple(ids[i : i + n])) for i in range(len(ids) - n + 1)}


def choosing_runs(tokenizer) -> set[int]:
    """:func:`token_runs` of the whole choosing corpus (every section of the built-in documentation, as
    :func:`lynxkv.hf.prompts.document` joins them, and the built-in question): what held-out text must avoid,
    whichever of its prompts a scheme was chosen on."""
    whole = "\n\n".join(f"## {name}\n\n{text}" for name, text in corpus_sections())
    return token_runs(tokenizer(whole).input_ids) | token_runs(tokenizer(QUESTION).input_ids)


def text_cases(tokenizer, text: str, tokens: int, count: int, continuation: int,
               avoid: set[int] | None = None) -> tuple[list[Case], int]:
    """Up to ``count`` (prompt ids ``[tokens]``, continuation ids ``[continuation]``) pairs cut one after the other
    from ``text``, and how many pieces were skipped.

    A piece is ``tokens + continuation`` consecutive tokens (the prompt, then its continuation) and pieces follow
    each other without a gap; a piece that shares a run of :data:`OVERLAP_TOKENS` tokens with ``avoid`` (the
    choosing corpus's :func:`token_runs`) or with a piece taken before it is skipped, so the two corpora share no
    text and no two prompts do either.
    """
    ids = tokenizer(text).input_ids
    stride = tokens + continuation
    seen = set(avoid or ())
    cases, skipped = [], 0
    for start in range(0, len(ids) - stride + 1, stride):
        if len(cases) == count:
            break
        piece = ids[start : start + stride]
        runs = token_runs(piece)
        if not runs.isdisjoint(seen):
            skipped += 1
            continue
        seen |= runs
        prompt = torch.tensor(piece[:tokens], dtype=torch.long)
        cases.append((prompt, torch.tensor(piece[tokens:], dtype=torch.long) if continuation else None))
    if not cases:
        reason = f"; {skipped} piece(s) overlap the choosing corpus or each other" if skipped else ""
        raise InputError(f"held-out text: its {len(ids)} tokens give no prompt of {tokens} tokens plus {continuation} "
                         f"for perplexity{reason}")
    return cases, skipped


def stdlib_corpus() -> Corpus:
    """The default held-out corpus (:func:`stdlib_text`)."""
    return Corpus("heldout", f"Python standard-library source ({len(STDLIB_MODULES)} modules)", stdlib_text())


def corpus_cases(corpus: Corpus, tokenizer, tokens: int, count: int, continuation: int,
                 avoid: set[int] | None = None) -> tuple[list[Case], int]:
    """``count`` cases of ``tokens`` tokens from ``corpus`` and how many pieces were skipped (see
    :func:`text_cases`; the built-in prompts start at :func:`prompt_starts` and skip nothing)."""
    if corpus.text is None:
        return [builtin_case(tokenizer, tokens, s, continuation) for s in prompt_starts(count)], 0
    return text_cases(tokenizer, corpus.text, tokens, count, continuation, avoid)


def load_kv_dump(path: str) -> KVPairs:
    """Per-layer (keys, values) ``[H, T, D]`` in fp32 from a safetensors KV dump (the naming conventions of
    :mod:`lynxkv.cache.dumps`: ``layers.{i}.key`` / ``past_key_values.{i}.value``, ``[H, T, D]`` or ``[1, H, T, D]``).
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
