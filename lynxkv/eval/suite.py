"""A whole evaluation: codecs × corpora × context lengths × prompts on a model, or codecs on a KV dump.

The result is one JSON-ready dict:

    {"kind": "model" | "kv", "model": ..., "window": W, "windows": per prompt, "tie_margin": m, "ppl_tokens": N,
     "corpora": [{"role": "heldout" | "choosing" | "kv", "name": ..., "lengths": [
                   {"tokens": 1000, "prompt_tokens": [...], "skipped_overlapping": 0, "codecs": {name: summary}},
                   ...]}, ...],
     "seconds": wall time, "cpu_seconds": process CPU time}

Summaries hold means over prompts and their standard errors, the accepted prefix pooled over every window (see
:func:`lynxkv.eval.harness.summarize`); the vNMSE figures are the per-layer global ratio averaged over layers
(``k_vnmse``) and the per-vector mean (``k_vnmse_pv``). Corpora come in the order given; ``lynxkv eval`` puts
the held-out one first, the one to report.
"""

from __future__ import annotations

import time

from lynxkv.eval import harness
from lynxkv.eval.cases import Corpus, choosing_runs, corpus_cases, load_kv_dump
from lynxkv.eval.windows import TIE_MARGIN


def evaluate_model(
    loaded,
    codecs: list,
    corpora: list[Corpus],
    *,
    lengths: list[int],
    prompts: int = 4,
    window: int = 64,
    ppl_tokens: int = 64,
    windows: int = 1,
    tie_margin: float = TIE_MARGIN,
    progress=None,
) -> dict:
    """Score ``codecs`` on ``prompts`` prompts of each corpus in ``corpora`` for each length in ``lengths``
    (tokens), ``windows`` windows of ``window`` tokens per prompt, along the text that follows it
    (:mod:`lynxkv.eval.windows`; ``tie_margin``: the near-tie threshold). Held-out text is cut so that it shares
    no run of tokens with the choosing corpus (:func:`lynxkv.eval.cases.text_cases`), whether or not the choosing
    corpus is among ``corpora``."""
    t0, c0 = time.perf_counter(), time.process_time()
    avoid = choosing_runs(loaded.tokenizer) if any(c.text is not None for c in corpora) else None
    result = {"kind": "model", "model": loaded.name, "window": window, "windows": windows, "tie_margin": tie_margin,
              "ppl_tokens": ppl_tokens, "corpora": []}
    for corpus in corpora:
        blocks = []
        for tokens in lengths:
            need = max(ppl_tokens, (windows - 1) * window)  # the text after a prompt: for ΔPPL and the windows
            cases, skipped = corpus_cases(corpus, loaded.tokenizer, tokens, prompts, need, avoid)
            task = progress.add_task(f"{corpus.role}, {tokens} tokens", total=len(cases) * len(codecs) * windows) \
                if progress else None
            tick = (lambda: progress.advance(task)) if progress else None
            per_prompt = [harness.score_prompt(loaded.model, ids, codecs, window, cont, tick,
                                               windows_per_prompt=windows, ppl_tokens=ppl_tokens,
                                               tie_margin=tie_margin)
                          for ids, cont in cases]
            blocks.append({
                "tokens": tokens, "prompt_tokens": [int(ids.numel()) for ids, _ in cases],
                "skipped_overlapping": skipped, "codecs": harness.summarize(per_prompt, codecs, window),
            })  # fmt: skip
        result["corpora"].append({"role": corpus.role, "name": corpus.name, "lengths": blocks})
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
    block = {"tokens": tokens, "prompt_tokens": [tokens], "codecs": harness.summarize([scores], codecs, 0)}
    return {
        "kind": "kv",
        "model": None,
        "corpora": [{"role": "kv", "name": path, "lengths": [block]}],
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
    }
