"""A whole evaluation: codecs × context lengths × prompts on a model, or codecs on a KV dump.

The result is one JSON-ready dict:

    {"model": ..., "window": W, "heldout": N, "kind": "model" | "kv",
     "lengths": [{"tokens": 1000, "prompt_tokens": [...], "codecs": {name: summary}}, ...],
     "seconds": wall time, "cpu_seconds": process CPU time}

Summaries hold means over prompts (see :func:`lynxkv.eval.harness.summarize`); the vNMSE figures are the
per-layer global ratio averaged over layers (``k_vnmse``) and the per-vector mean (``k_vnmse_pv``).
"""

from __future__ import annotations

import time

from lynxkv.eval import harness
from lynxkv.eval.cases import builtin_case, load_kv_dump, prompt_starts, text_cases


def evaluate_model(
    loaded,
    codecs: list,
    *,
    lengths: list[int],
    prompts: int = 4,
    window: int = 64,
    heldout: int = 64,
    prompt_offset: int = 0,
    text: str | None = None,
    progress=None,
) -> dict:
    """Score ``codecs`` on ``prompts`` prompts for each length in ``lengths`` (tokens): built-in prompts, or
    consecutive pieces of ``text`` when given."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = {
        "kind": "model", "model": loaded.name, "window": window, "heldout": heldout,
        "prompt_offset": prompt_offset, "lengths": [],
    }  # fmt: skip
    for tokens in lengths:
        task = progress.add_task(f"{tokens} tokens", total=prompts * len(codecs)) if progress else None
        tick = (lambda: progress.advance(task)) if progress else None
        per_prompt, sizes = [], []
        if text is None:
            starts = prompt_starts(prompts, prompt_offset)
            cases = (builtin_case(loaded.tokenizer, tokens, s, heldout) for s in starts)
        else:
            cases = iter(text_cases(loaded.tokenizer, text, tokens, prompts, heldout))
        for ids, held in cases:
            sizes.append(int(ids.numel()))
            per_prompt.append(harness.score_prompt(loaded.model, ids, codecs, window, held, tick))
        result["lengths"].append(
            {"tokens": tokens, "prompt_tokens": sizes, "codecs": harness.summarize(per_prompt, codecs, window)}
        )
    result["seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = time.process_time() - c0
    return result


def evaluate_kv(path: str, codecs: list, *, progress=None) -> dict:
    """KV-only scores of ``codecs`` on a safetensors KV dump."""
    t0, c0 = time.perf_counter(), time.process_time()
    kv = load_kv_dump(path)
    task = progress.add_task("kv dump", total=len(codecs)) if progress else None
    scores = harness.score_kv(kv, codecs, (lambda: progress.advance(task)) if progress else None)
    tokens = int(kv[0][0].shape[1])
    return {
        "kind": "kv",
        "model": None,
        "source": path,
        "lengths": [{"tokens": tokens, "prompt_tokens": [tokens], "codecs": harness.summarize([scores], codecs, 0)}],
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
    }

