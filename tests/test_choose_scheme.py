"""The anchor chosen per cache (lynxkv.hf.choose): the candidate whose anchor the model scores closest to the exact
cache on the prompt's held-out last tokens is the one written, in whatever order the candidates come."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from lynxkv.hf import prefill
from lynxkv.hf.choose import CANDIDATES, MIN_CONTEXT, PROBE_TOKENS, choose_scheme
from lynxkv.quant.scheme import DEFAULT

#: an anchor of 1 bit: a far worse draft than the default's 4 on any model
COARSE = DEFAULT.replace(anchor_bits=1, residual_bits=7)


def _prompt(model, tokens: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.config.vocab_size, (tokens,), generator=g)
    kv, _ = prefill(model, ids)
    return ids, kv


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_better_anchor_is_chosen_whatever_the_candidates_order(arch):
    model = make_tiny_model(arch)
    ids, kv = _prompt(model, MIN_CONTEXT + PROBE_TOKENS + 8)
    for candidates in ((DEFAULT, COARSE), (COARSE, DEFAULT)):
        choice = choose_scheme(model, ids, kv, candidates)
        assert choice.scheme == DEFAULT
        assert choice.probe_tokens == PROBE_TOKENS
        kl = dict(zip(candidates, choice.kl))
        assert 0 <= kl[DEFAULT] < kl[COARSE]


def test_the_choice_depends_on_the_cache_not_on_the_order_of_equal_candidates():
    model = make_tiny_model("llama")
    ids, kv = _prompt(model, MIN_CONTEXT + PROBE_TOKENS)
    choice = choose_scheme(model, ids, kv, (DEFAULT, DEFAULT))  # a tie keeps the first
    assert choice.scheme == DEFAULT and choice.kl[0] == choice.kl[1]
    again = choose_scheme(model, ids, kv)
    assert again == choose_scheme(model, ids, kv)  # deterministic
    assert again.scheme in CANDIDATES and len(again.kl) == len(CANDIDATES)


def test_a_prompt_too_short_to_probe_keeps_the_first_candidate():
    model = make_tiny_model("llama")
    ids, kv = _prompt(model, MIN_CONTEXT + PROBE_TOKENS - 1)
    choice = choose_scheme(model, ids, kv, (COARSE, DEFAULT))
    assert choice.scheme == COARSE and choice.kl == () and choice.probe_tokens == 0


def test_encode_model_writes_the_chosen_anchor_and_says_so(tmp_path, capsys):
    import json

    from cli_helpers import run_cli
    from runner_helpers import save_tiny_model_dir, word

    from lynxkv.cache import open_cache

    model_dir = save_tiny_model_dir(make_tiny_model("llama"), tmp_path / "m")
    (tmp_path / "p.txt").write_text(" ".join(word(i % 100 + 2) for i in range(120)))
    base = ["encode", "--model", model_dir, "--prompt-file", tmp_path / "p.txt", "--json"]
    code, out, err = run_cli(capsys, *base, "-o", tmp_path / "auto.lynx")
    assert code == 0, err
    choice = json.loads(out)["choice"]
    kl = {c["name"]: c["kl"] for c in choice["candidates"]}
    assert set(kl) == {"default", "plain-keys"} and choice["chosen"] == min(kl, key=kl.get)
    with open_cache(tmp_path / "auto.lynx") as cache:
        assert cache.info.scheme.describe() == choice["scheme"]
    # a preset, or an option fixing what the candidates differ in, is written as asked: nothing is probed
    for argv, rotation in ((["--scheme", "plain-keys"], "none"), (["--alpha", "2"], "hadamard")):
        code, out, err = run_cli(capsys, *base, *argv, "-o", tmp_path / f"{argv[-1]}.lynx")
        assert code == 0, err
        assert json.loads(out)["choice"]["probe_tokens"] == 0
        with open_cache(tmp_path / f"{argv[-1]}.lynx") as cache:
            assert cache.info.scheme.key_rotation == rotation


@pytest.mark.slow
@pytest.mark.parametrize("short, chosen", [("smollm2", "default"), ("gemma3-270m", "plain-keys")])
def test_the_choice_follows_the_model_family(short, chosen):
    """On SmolLM2 the default's rotated keys draft closer to the exact cache, on Gemma 3 the plain keys
    (docs/evaluation.md, "The anchor chosen per cache"): the same probe picks each model's own."""
    from lynxkv.errors import InputError
    from lynxkv.hf.choose import LABELS
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prompts import builtin_prompt

    try:
        loaded = load_model(short)
    except InputError as exc:
        pytest.skip(str(exc))
    ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, 2000))
    kv, _ = prefill(loaded.model, ids)
    choice = choose_scheme(loaded.model, ids, kv)
    assert LABELS[CANDIDATES.index(choice.scheme)] == chosen, choice.to_dict()
