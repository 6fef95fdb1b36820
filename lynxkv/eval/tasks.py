"""Task accuracy: what a stored cache does to the model's answers (``lynxkv eval --task``).

Two tasks, each on text from :mod:`lynxkv.eval.prose` (no part in choosing any default):

- **perplexity**: ``documents`` consecutive pieces of ``context + scored`` tokens. The first ``context − 1``
  tokens are prefilled, their cache goes through each codec, and one teacher-forced forward of the next
  ``scored`` inputs on the decoded cache gives the loss on tokens ``context … context + scored − 1`` (every scored
  token depends on the stored cache, as in a draft window). Perplexity is ``exp(Σ NLL / Σ tokens)`` over all
  documents; ΔPPL is against the original cache, with the s.e.m. of the per-document changes.
- **passkey**: a five-digit key is hidden at a depth (0 = just after the instructions, 1 = just before the
  question) of filler prose, the whole prompt of ``length`` tokens (answer included) is prefilled, its cache
  goes through each codec, and the answer is checked on the decoded cache. A trial is an exact match when
  greedy decoding emits the key's tokens: that holds exactly when, fed the key's own tokens (teacher forcing),
  the argmax at every position is the key's next token, so one forward of the answer decides it. Each (length,
  depth) cell holds ``trials`` keys and filler windows, drawn deterministically from ``seed``; accuracies come with
  their Wilson 95% interval.

Every cache is built in the model's dtype (fp32 or bf16): the original cache is what the model produced, each
codec's reconstruction is cast back to that dtype before the forward (the exact tier's is that dtype already:
:mod:`lynxkv.eval.exact_tier`).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Callable

import torch

from lynxkv.errors import InputError
from lynxkv.eval.baselines import bits_kv, registry
from lynxkv.eval.draft import forward_logits
from lynxkv.eval.exact_tier import EXACT_CODEC, ExactTier
from lynxkv.eval.harness import roundtrip_cache
from lynxkv.hf import prefill

TASKS = ("perplexity", "passkey")

#: The codecs a task run compares by default: the original cache, Lynx's full code, the full code with the exact
#: tier, the anchor alone, plain INT8 (per tensor), INT4 per token (groups of 64), KIVI-4 and KIVI-2.
DEFAULT_CODECS = ("fp32", "lynx-default", EXACT_CODEC, "lynx-default-anchor", "int8-tensor", "int4-g64", "kivi4",
                  "kivi2")
REFERENCE = "fp32"  # the identity codec: the cache as the model produced it

DEFAULT_LENGTHS = (1024, 2048)
FULL_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

INSTRUCTIONS = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                "memorize it. I will quiz you about it.\n\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"

Tick = Callable[[], None]


@dataclass(frozen=True)
class Grid:
    """What a task run measures."""

    tasks: tuple[str, ...] = TASKS
    context: int = 1024  # perplexity: tokens prefilled (the stored cache holds context − 1)
    scored: int = 256  # perplexity: tokens scored after the context
    documents: int = 8
    lengths: tuple[int, ...] = DEFAULT_LENGTHS  # passkey: prompt + answer tokens
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 2  # passkey keys per (length, depth) cell
    seed: int = 0

    def longest(self) -> tuple[int, str]:
        """The most tokens one forward needs, and the option that asks for it."""
        need = []
        if "perplexity" in self.tasks:
            need.append((self.context + self.scored, f"--tokens {self.context} + --ppl-tokens {self.scored}"))
        if "passkey" in self.tasks:
            need.append((max(self.lengths), f"--lengths {tokens_label(max(self.lengths))}"))
        return max(need)


def parse_tasks(spec: str) -> tuple[str, ...]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise InputError("--task: no task named; known: perplexity, passkey, all")
    out: list[str] = []
    for name in names:
        if name == "all":
            out += [t for t in TASKS if t not in out]
        elif name in TASKS:
            out += [name] if name not in out else []
        else:
            raise InputError(f"--task: unknown task {name!r}; known: perplexity, passkey, all")
    return tuple(t for t in TASKS if t in out)


def parse_lengths(spec: str, option: str = "--lengths") -> tuple[int, ...]:
    """``1K,2K,4096`` → ``(1024, 2048, 4096)`` (K = 1024 tokens)."""
    out = []
    for raw in spec.split(","):
        item = raw.strip()
        m = re.fullmatch(r"(\d+)([kK]?)", item)
        if not m:
            raise InputError(f"{option}: expected token counts like 1K,2K,4096, got {item!r}")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 64:
            raise InputError(f"{option}: expected at least 64 tokens, got {item!r}")
        out.append(n)
    if not out:
        raise InputError(f"{option}: no length given")
    return tuple(sorted(set(out)))


def parse_depths(spec: str) -> tuple[float, ...]:
    try:
        depths = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise InputError(f"--depths: expected fractions between 0 and 1 like 0,0.5,1, got {spec!r}") from None
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise InputError(f"--depths: expected fractions between 0 and 1 like 0,0.5,1, got {spec!r}")
    return tuple(sorted(set(depths)))


def tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def task_codecs(names: str | None) -> list:
    """The codecs named (comma-separated; ``None``: :data:`DEFAULT_CODECS`), the original first."""
    from lynxkv.eval.baselines import select

    pool = {**registry(), EXACT_CODEC: ExactTier()}
    if not names:
        codecs = [pool[n] for n in DEFAULT_CODECS]
    else:  # the exact tier is a task codec only (it needs the cache in its own dtype), the rest as for --schemes
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        codecs = [pool[n] if n == EXACT_CODEC else select(n)[0] for n in wanted]
    if not codecs:
        raise InputError("--schemes: no codec named")
    ref = [c for c in codecs if c.name == REFERENCE] or [pool[REFERENCE]]
    return ref + [c for c in codecs if c.name != REFERENCE]


def check_context(grid: Grid, max_context: int | None, model: str) -> None:
    """One clear error when the grid needs more tokens than the model's context holds."""
    need, option = grid.longest()
    if max_context is not None and need > max_context:
        raise InputError(f"{option}: needs {need} tokens but model {model} has a context of {max_context} tokens "
                         "(max_position_embeddings)")


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``hits / n`` (95% for ``z = 1.96``)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _float_kv(kv):
    return [(k.float(), v.float()) for k, v in kv]


def _bits(codec, kv, model_dtype: torch.dtype) -> float:
    if codec.name == REFERENCE:
        return float(torch.finfo(model_dtype).bits)
    shape = tuple(kv[0][0].shape)
    return (bits_kv(codec, shape, "key") + bits_kv(codec, shape, "value")) / 2


def stored(codec, kv) -> tuple[list, float]:
    """The cache the model reads after ``kv`` (its own prefill, in its dtype) is stored in ``codec``, and the bits
    per element: the exact tier through the cache API, every other codec's round trip in fp32 (cast back to the
    model's dtype by the forward)."""
    if isinstance(codec, ExactTier):
        return codec.store(kv)
    return roundtrip_cache(codec, _float_kv(kv)), _bits(codec, kv, kv[0][0].dtype)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def documents(ids: list[int], grid: Grid) -> list[list[int]]:
    """The perplexity documents: consecutive pieces of ``context + scored`` tokens from the start of ``ids``."""
    size = grid.context + grid.scored
    docs = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)][: grid.documents]
    if len(docs) < grid.documents:
        raise InputError(f"task corpus: its {len(ids)} tokens give {len(docs)} of the {grid.documents} documents "
                         f"of {size} tokens asked for; give a larger --corpus or fewer --prompts")
    return docs


@torch.no_grad()
def run_perplexity(model, ids: list[int], grid: Grid, codecs: list, tick: Tick | None = None) -> dict:
    nll: dict[str, list[float]] = {c.name: [] for c in codecs}
    bits: dict[str, list[float]] = {c.name: [] for c in codecs}
    for doc in documents(ids, grid):
        kv, _ = prefill(model, torch.tensor(doc[: grid.context - 1]))  # the model's dtype
        inputs = torch.tensor(doc[grid.context - 1 : grid.context - 1 + grid.scored])
        targets = torch.tensor(doc[grid.context : grid.context + grid.scored])
        for codec in codecs:
            approx, b = stored(codec, kv)
            logits = forward_logits(model, approx, inputs)  # [scored, V]
            nll[codec.name].append(float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum")))
            bits[codec.name].append(b)
            if tick:
                tick()
    ref = nll[REFERENCE]
    count = grid.scored * len(ref)
    out = {}
    for codec in codecs:
        mine = nll[codec.name]
        per_doc = [math.exp((a - b) / grid.scored) - 1.0 for a, b in zip(mine, ref)]
        sem = _std(per_doc) / math.sqrt(len(per_doc)) if len(per_doc) > 1 else 0.0
        out[codec.name] = {"bits": _mean(bits[codec.name]), "ppl": math.exp(sum(mine) / count),
                           "ppl_delta": math.exp((sum(mine) - sum(ref)) / count) - 1.0, "ppl_delta_sem": sem,
                           "nll_documents": mine}
    return {"context": grid.context, "scored": grid.scored, "documents": len(ref), "codecs": out}


def passkey_prompt(tokenizer, filler: list[int], length: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """Prompt ids and the answer's ids of one trial: instructions, filler with the needle at ``depth``, the
    question; prompt + answer hold exactly ``length`` tokens (``filler`` must hold enough)."""
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    head, needle, question, answer = enc(INSTRUCTIONS), enc(NEEDLE.format(key=key)), enc(QUESTION), \
        enc(ANSWER.format(key=key))
    room = length - len(head) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise InputError(f"--lengths {length}: too short for the passkey prompt ({length - room} tokens)")
    if room > len(filler):
        raise InputError(f"task corpus: {len(filler)} tokens cannot fill a passkey prompt of {length} tokens; give "
                         "a larger --corpus or shorter --lengths")
    cut = round(depth * room)
    return head + filler[:cut] + needle + filler[cut:room] + question, answer


@torch.no_grad()
def run_passkey(model, tokenizer, ids: list[int], grid: Grid, codecs: list, tick: Tick | None = None) -> dict:
    hits = {c.name: [[0] * len(grid.depths) for _ in grid.lengths] for c in codecs}
    bits: dict[str, list[float]] = {c.name: [] for c in codecs}
    for li, length in enumerate(grid.lengths):
        for di, depth in enumerate(grid.depths):
            for trial in range(grid.trials):
                rng = random.Random(f"passkey/{grid.seed}/{length}/{depth}/{trial}")
                key = str(rng.randrange(10000, 100000))
                start = rng.randrange(max(len(ids) - length, 1))
                prompt, answer = passkey_prompt(tokenizer, ids[start:], length, depth, key)
                kv, _ = prefill(model, torch.tensor(prompt[:-1]))
                inputs = torch.tensor(prompt[-1:] + answer[:-1])
                for codec in codecs:
                    approx, b = stored(codec, kv)
                    logits = forward_logits(model, approx, inputs)
                    hits[codec.name][li][di] += int(logits.argmax(-1).tolist() == answer)
                    bits[codec.name].append(b)
                    if tick:
                        tick()
    n_len = grid.trials * len(grid.depths)
    out = {}
    for codec in codecs:
        h = hits[codec.name]
        total, n = sum(map(sum, h)), n_len * len(grid.lengths)
        lo, hi = wilson(total, n)
        by_length = [{"tokens": length, "hits": sum(row), "trials": n_len,
                      "interval": list(wilson(sum(row), n_len))} for length, row in zip(grid.lengths, h)]
        out[codec.name] = {"bits": _mean(bits[codec.name]), "hits": total, "trials": n, "accuracy": total / n,
                           "interval": [lo, hi], "by_length": by_length, "cells": h}
    return {"lengths": list(grid.lengths), "depths": list(grid.depths), "trials_per_cell": grid.trials,
            "codecs": out}


def estimated_steps(grid: Grid, codecs: list) -> dict[str, int]:
    """Progress totals: one step per (document or trial, codec)."""
    out = {}
    if "perplexity" in grid.tasks:
        out["perplexity"] = grid.documents * len(codecs)
    if "passkey" in grid.tasks:
        out["passkey"] = len(grid.lengths) * len(grid.depths) * grid.trials * len(codecs)
    return out


def targets(result: dict) -> list[dict]:
    """The issue's targets, checked on a result: Lynx's full code within 0.05% of the original's perplexity and
    its retrieval accuracy inside the original's interval; the anchor's perplexity increase no larger than
    KIVI-4's and its retrieval accuracy inside KIVI-4's interval; and the exact tier's answers those of the
    original cache, document by document and trial by trial. Only those whose codecs ran."""
    rows = []
    ppl = result.get("perplexity", {}).get("codecs", {})
    pk = result.get("passkey", {}).get("codecs", {})
    full, anchor, kivi = "lynx-default", "lynx-default-anchor", "kivi4"
    if full in ppl:
        d, sem, n = ppl[full]["ppl_delta"], ppl[full]["ppl_delta_sem"], len(ppl[full]["nll_documents"])
        rows.append({"target": "lynx full: |ΔPPL| ≤ 0.05%", "value": f"{d:+.3%} ± {sem:.3%} (s.e.m., {n} documents)",
                     "met": abs(d) <= 5e-4})
    if full in pk:
        lo, hi = pk[REFERENCE]["interval"]
        acc = pk[full]["accuracy"]
        rows.append({"target": "lynx full: passkey accuracy inside the original's 95% interval",
                     "value": f"{acc:.3f} in [{lo:.3f}, {hi:.3f}]", "met": lo <= acc <= hi})
    if EXACT_CODEC in ppl or EXACT_CODEC in pk:
        same = [ppl[EXACT_CODEC]["nll_documents"] == ppl[REFERENCE]["nll_documents"]] if EXACT_CODEC in ppl else []
        same += [pk[EXACT_CODEC]["cells"] == pk[REFERENCE]["cells"]] if EXACT_CODEC in pk else []
        rows.append({"target": "lynx exact tier: every loss and passkey answer identical to the original's",
                     "value": "identical" if all(same) else "different", "met": all(same)})
    if anchor in ppl and kivi in ppl:
        a, k = ppl[anchor], ppl[kivi]
        rows.append({"target": "lynx anchor: ΔPPL ≤ KIVI-4's (bits/el)",
                     "value": f"{a['ppl_delta']:+.3%} ({a['bits']:.2f}) vs {k['ppl_delta']:+.3%} ({k['bits']:.2f})",
                     "met": a["ppl_delta"] <= k["ppl_delta"]})
    if anchor in pk and kivi in pk:
        lo, hi = pk[kivi]["interval"]
        acc = pk[anchor]["accuracy"]
        rows.append({"target": "lynx anchor: passkey accuracy inside KIVI-4's 95% interval",
                     "value": f"{acc:.3f} in [{lo:.3f}, {hi:.3f}]", "met": lo <= acc <= hi})
    return rows


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def model_context(name: str | None) -> int | None:
    """The model's context (``max_position_embeddings``) read from its configuration alone, before any weights
    are loaded; ``None`` when the configuration does not say (or cannot be read: loading will then tell)."""
    from lynxkv.hf.models import DEFAULT_MODEL, _resolve, context_length

    try:
        from transformers import AutoConfig

        path, kwargs = _resolve(name or DEFAULT_MODEL)
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError):
        return None
    return context_length(config)


def evaluate(loaded, corpus, grid: Grid, codecs: list, *, progress=None) -> dict:
    """Run ``grid``'s tasks on ``loaded`` (a :class:`lynxkv.hf.models.LoadedModel`) with text from ``corpus`` (a
    :class:`lynxkv.eval.prose.TaskCorpus`): one JSON-ready dict with each task's per-codec results, the targets
    and the wall and CPU time."""
    import time

    from lynxkv.eval.prose import clean_ids

    t0, c0 = time.perf_counter(), time.process_time()
    ids, removed = clean_ids(loaded.tokenizer, corpus)
    result: dict = {
        "kind": "tasks", "model": loaded.name, "dtype": str(loaded.model.dtype).replace("torch.", ""),
        "corpus": corpus.name, "corpus_tokens": len(ids), "removed_overlapping_tokens": removed,
        "codecs": {c.name: getattr(c, "description", c.name) for c in codecs}, "grid": {
            "tasks": list(grid.tasks), "context": grid.context, "scored": grid.scored, "documents": grid.documents,
            "lengths": list(grid.lengths), "depths": list(grid.depths), "trials": grid.trials, "seed": grid.seed},
    }  # fmt: skip
    steps = estimated_steps(grid, codecs)

    def ticker(name: str):
        if progress is None:
            return None
        task = progress.add_task(name, total=steps[name])
        return lambda: progress.advance(task)

    if "perplexity" in grid.tasks:
        result["perplexity"] = run_perplexity(loaded.model, ids, grid, codecs, ticker("perplexity"))
    if "passkey" in grid.tasks:
        result["passkey"] = run_passkey(loaded.model, loaded.tokenizer, ids, grid, codecs, ticker("passkey"))
    result["targets"] = targets(result)
    result["seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = time.process_time() - c0
    return result
