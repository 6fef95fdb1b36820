"""The runner step of ``benchmarks/gpu_check.sh``: Lynx's speculative runner on the device against the monolithic
full code (``RunConfig(speculate=False)``) and plain decoding (``decode_plain``), per token count and link rate.

A random-weight model and synthetic KV (no prefill: the cache is saved with the prompt ids it stands for and the
model's fingerprint), saved with ``save_cache``, loaded onto the device with ``load_kv(device=...)`` (anchor-only
and full), handed to the runner by a :class:`~lynxkv.cache.loading.PreparedLoad` that releases the anchor after
its bytes over the link and the residual after both (one link, anchor first). Only public fields are read:
``RunConfig(max_new_tokens=, speculate=)`` and the stats' ``first_commit_s``, ``tt(n)``, ``draft_step_s``,
``decode_step_s``, ``drafted``, ``accepted``. Plain decoding is compared with the forward shapes of the run where
the stats say them (``draft_token_ids`` and the branch's ``branch_at`` / ``branch_token_ids``; bf16 rounds one
multi-token forward differently from single steps), else token by token.

Then the path users run, once: ``lynxkv run CACHE --model DIR --device DEVICE`` in a process of its own (the
progressive reader decoding onto the device, the model loaded there by name), on a model of the same shape with
its first two layers saved as a Hugging Face directory (with a word-level tokenizer), at the first token count,
over a link on which the residual takes half a second; its tokens are checked against plain decoding of that
model on the device, with the run's forward shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch


def _run(model, anchor_kv, full_kv, prompt, fp, info, gbits: float, n: int, speculate: bool):
    """One run over an emulated link of ``gbits`` Gbit/s: (tokens, stats)."""
    from lynxkv.cache.loading import PreparedLoad
    from lynxkv.speculative import RunConfig, run

    rate = gbits * 1e9 / 8  # bytes per second
    load = PreparedLoad(anchor_kv, full_kv, anchor_delay=info.anchor_bytes / rate,
                        residual_delay=(info.anchor_bytes + info.residual_bytes) / rate, prompt_token_ids=prompt,
                        model_fingerprint=fp, anchor_bytes=info.anchor_bytes, residual_bytes=info.residual_bytes)
    try:
        res = run(model, load, RunConfig(max_new_tokens=n, speculate=speculate))
    finally:
        load.close()
    return res.token_ids, res.stats


def _times(stats, n: int) -> dict:
    return {"first_commit_s": stats.first_commit_s, "tt1_s": stats.tt(1), f"tt{n}_s": stats.tt(n),
            "draft_step_s": stats.draft_step_s, "decode_step_s": stats.decode_step_s,
            "drafted": stats.drafted, "accepted": stats.accepted}


def _reference(model, full_kv, prompt, n: int, stats, plain: list[int]) -> tuple[list[int], str]:
    """Plain decoding with the run's forward shapes where its stats give them, else the token-by-token tokens."""
    from lynxkv.speculative import decode_plain

    if not stats.draft_token_ids:
        return plain, "token by token"
    return decode_plain(model, full_kv, prompt, n, first_forward=list(stats.draft_token_ids),
                        branch=(stats.branch_at, stats.branch_token_ids)), "the run's forward shapes"


def _one_length(st, model, fp, t: int, gbits: list[float], n: int, tmp: str, result: dict, flush) -> bool:
    """Every link rate at ``t`` tokens; appends to ``result["runs"]``; False when a check failed."""
    import lynxkv
    from lynxkv.speculative import decode_plain

    st.reset_peak()
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (t,), generator=torch.Generator().manual_seed(t)).tolist()
    path = os.path.join(tmp, f"r{t}.lynx")
    kv = st.kv(t, seed=t)
    info = lynxkv.save_cache(path, kv, prompt_token_ids=prompt, model_fingerprint=fp)
    del kv
    with lynxkv.open_cache(path) as cache:
        anchor_kv = cache.load_kv(anchor_only=True, device=st.device)
        full_kv = cache.load_kv(device=st.device)
    plain_s, plain = st.timed(lambda: decode_plain(model, full_kv, prompt, n))
    cache_bytes = sum(x.numel() * x.element_size() for pair in full_kv for x in pair)
    length = {"tokens": t, "kv_bytes": cache_bytes, "anchor_file_bytes": info.anchor_bytes,
              "residual_file_bytes": info.residual_bytes, "plain_decode_s": plain_s, "rates": []}
    result["runs"].append(length)
    ok = True
    for g in gbits:
        row: dict = {"gbits": g, "anchor_due_s": info.anchor_bytes * 8 / (g * 1e9),
                     "residual_due_s": (info.anchor_bytes + info.residual_bytes) * 8 / (g * 1e9)}
        try:
            lynx_tokens, lynx = _run(model, anchor_kv, full_kv, prompt, fp, info, g, n, True)
            mono_tokens, mono = _run(model, anchor_kv, full_kv, prompt, fp, info, g, n, False)
            ref, how = _reference(model, full_kv, prompt, n, lynx, plain)
            row.update(lynx=_times(lynx, n), monolithic=_times(mono, n), reference=how,
                       lynx_identical=lynx_tokens == ref, monolithic_identical=mono_tokens == plain)
            row["tokens_identical"] = row["lynx_identical"] and row["monolithic_identical"]
            row["ok"] = row["tokens_identical"] and len(lynx_tokens) == n
        except Exception as exc:  # noqa: BLE001 - one failing rate is recorded; the others still run
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
        ok &= row["ok"]
        length["rates"].append(row)
        length["peak_device_bytes"] = st.peak_bytes()
        flush()
        ly, mo = row.get("lynx", {}), row.get("monolithic", {})
        print(f"[runner] {t} tokens, {g:g} Gbit/s: TT1 {ly.get('tt1_s')} vs {mo.get('tt1_s')} s, "
              f"TT{n} {ly.get(f'tt{n}_s')} vs {mo.get(f'tt{n}_s')} s, drafted {ly.get('drafted')} accepted "
              f"{ly.get('accepted')}, identical {row.get('tokens_identical')} {row.get('error', '')}", flush=True)
    return ok


CLI_LAYERS = 2  # the CLI check's model: the runner's shape, its first two layers (saved and loaded in seconds)
CLI_RESIDUAL_S = 0.5  # the CLI check's link: the residual's bytes take this long after the anchor's


def _save_model_dir(model, path: str) -> None:
    """``model`` and a word-level tokenizer (token i is the word ``t<i>``) as a Hugging Face directory that
    ``lynxkv run --model PATH`` loads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(model.config.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(path)
    config = os.path.join(path, "tokenizer_config.json")
    with open(config) as f:
        settings = json.load(f)
    with open(config, "w") as f:  # not the model type's own tokenizer class (Llama's would want its BPE files)
        json.dump({**settings, "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def _cli_check(st, build_model, t: int, n: int, tmp: str) -> dict:
    """``lynxkv run CACHE --model DIR --device DEVICE`` as a user runs it (see the module docstring)."""
    import lynxkv
    from lynxkv.hf.models import load_model
    from lynxkv.speculative import decode_plain

    model_dir, path = os.path.join(tmp, "cli-model"), os.path.join(tmp, "cli.lynx")
    _save_model_dir(build_model(st, layers=CLI_LAYERS), model_dir)
    loaded = load_model(model_dir, dtype=st.dtype, device=st.device)  # what the command loads
    prompt = torch.randint(loaded.model.config.vocab_size, (t,), generator=torch.Generator().manual_seed(t)).tolist()
    info = lynxkv.save_cache(path, st.kv(t, seed=t, layers=CLI_LAYERS), prompt_token_ids=prompt,
                             model_fingerprint=loaded.fingerprint)
    rate = info.residual_bytes / CLI_RESIDUAL_S  # a window to draft in, whatever the machine's step
    command = [sys.executable, "-m", "lynxkv", "run", path, "--model", model_dir, "--device", str(st.device),
               "--dtype", "fp32" if st.dtype == torch.float32 else "bf16", "-n", str(n), "--ignore-eos", "--json",
               "--bandwidth", f"{rate:.0f}B/s"]
    row = {"command": " ".join(["lynxkv"] + command[3:]), "tokens": t, "gbits": rate * 8 / 1e9,
           "residual_due_s": (info.anchor_bytes + info.residual_bytes) / rate}
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90)
    row["process_s"] = time.perf_counter() - t0  # imports, model load and warm-up included
    if proc.returncode != 0:
        return {**row, "ok": False, "error": proc.stderr.strip()[-1500:]}
    doc = json.loads(proc.stdout)
    stats = doc["stats"]
    with lynxkv.open_cache(path) as cache:
        full = cache.load_kv(dtype=torch.float32, device=st.device)  # the reader's dtype, as in the run
    want = decode_plain(loaded.model, full, prompt, n, first_forward=list(stats["draft_token_ids"]) or None,
                        branch=(stats["branch_at"], stats["branch_token_ids"]))
    commits = stats["commit_times_s"]
    row.update({k: stats[k] for k in ("first_commit_s", "draft_step_s", "decode_step_s", "drafted", "accepted")},
               tt1_s=commits[0] if commits else None, **{f"tt{n}_s": commits[n - 1] if len(commits) >= n else None},
               verified=doc["verified"], identical=doc["token_ids"] == want)
    row["ok"] = row["identical"] and doc["verified"] and len(doc["token_ids"]) == n
    return row


def measure_runner(st, build_model, args, write) -> int:
    """The runner step: every token count and link rate of ``args`` (defaults: 8K and 32K tokens, 10/25/50
    Gbit/s, 64 new tokens; the dry run: toy lengths, 24 new tokens and rates of 0.2-1 Mbit/s, which give the toy
    caches a drafting window of several draft steps)."""
    from lynxkv.hf.models import model_fingerprint

    tokens = args.tokens or ([32, 64] if st.dry else [8192, 32768])
    gbits = args.gbits or ([0.0002, 0.0005, 0.001] if st.dry else [10.0, 25.0, 50.0])
    n = args.new_tokens or (24 if st.dry else 64)
    model = build_model(st)
    params = sum(p.numel() for p in model.parameters())
    result = {"device": str(st.device), "dtype": str(st.dtype), "model_parameters": params,
              "model_config": {k: getattr(model.config, k) for k in ("num_hidden_layers", "hidden_size",
                                                                      "intermediate_size", "num_attention_heads",
                                                                      "num_key_value_heads", "head_dim",
                                                                      "vocab_size")},
              "new_tokens": n, "gbits": gbits, "runs": []}
    fp = model_fingerprint(model)
    ok = True
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for t in tokens:
            try:
                ok &= _one_length(st, model, fp, t, gbits, n, tmp, result, lambda: write(args.json, result))
            except Exception as exc:  # noqa: BLE001 - a failing length (out of memory) is recorded; the next runs
                ok = False
                result["runs"].append({"tokens": t, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                                       "traceback": traceback.format_exc()[-2000:]})
                print(f"[runner] {t} tokens failed: {exc}", flush=True)
            write(args.json, result)
            st.reset_peak()
        try:  # the public path last: the measurements above come first within the step's time
            result["cli"] = _cli_check(st, build_model, tokens[0], n, tmp)
        except Exception as exc:  # noqa: BLE001 - recorded, as a failing length is
            result["cli"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-2000:]}
        ok &= result["cli"]["ok"]
        write(args.json, result)
        cli = result["cli"]
        print(f"[runner] {cli.get('command', 'lynxkv run')}: ok {cli['ok']} in {cli.get('process_s')} s, TT1 "
              f"{cli.get('tt1_s')} s, drafted {cli.get('drafted')} accepted {cli.get('accepted')} "
              f"{cli.get('error', '')}", flush=True)
    return 0 if ok else 1
