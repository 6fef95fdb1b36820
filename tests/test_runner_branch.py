"""The branch of the drafts (greedy; lynxkv.speculative.branch): greedy output stays the full code's, token for token.

Each case is a tiny random model of the matrix with an anchor (the exact KV plus noise) found by seed so that its
greedy chain first leaves the full code's at a position d where the full code's token is the anchor's runner-up,
where the anchor's top-1 − top-2 margin is lower than at every earlier position, and where the anchor, given the
full code's token there, agrees with the next one: a fork at d (the bound between the two margins) is used and
keeps at least one of its drafts. Compared with decode_plain on the full code with the runner's forward shapes
(``first_forward``, ``branch``), and in fp32 also with plain sequential decoding. The margin below which a draft
forks is fixed (lynxkv.speculative.config.BRANCH_MARGIN); each case sets it where its fork must fall (``_margin``).
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch

from conftest import SLIDING_WINDOW, TINY_ARCHS, make_tiny_model
from lynxkv.cache.kv import TORCH_DTYPES
from lynxkv.cli import main
from lynxkv.speculative import RunConfig, Timing, decode_plain, request, run
from lynxkv.speculative.model_ops import first_step, forward_tokens, start_cache
from lynxkv.speculative.packed import shares_prefix
from runner_helpers import StepLoad, caches, perturbed, prompt_ids, single_thread, tiny_llama_cache

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

PROMPT = 4 * SLIDING_WINDOW + 6
WINDOW, NEW = 12, 20
DTYPES = ("fp32", "bf16")


def _margin(value: float) -> contextlib.AbstractContextManager:
    """Fork below ``value`` instead of the engine's fixed margin (0: never fork), for the ``with`` block."""
    return mock.patch.object(request, "BRANCH_MARGIN", value)


class _LongVerify(Timing):
    """The verify looks very long: the layered verify starts at the first chance."""

    def verify_estimate(self, rows, step, *, batch=False):
        return 1e4


def _chain(model, kv, ids, n, forced=None):
    """n greedy steps on ``kv`` as the runner drafts them: tokens, top-1 − top-2 margins, runner-ups, and with
    ``forced`` (teacher-forced on those tokens) the rank of each forced token."""
    keep, feed = first_step(ids, None)
    cache, pending = start_cache(model, kv, keep), feed
    tokens, margins, runner_up, ranks = [], [], [], []
    for i in range(n):
        logits = forward_tokens(model, cache, pending)[-1]
        top = logits.topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        runner_up.append(int(top.indices[1]))
        if forced is not None:
            ranks.append(int((logits > logits[forced[i]]).sum()))
        pending = [forced[i] if forced is not None else tokens[-1]]
    return tokens, margins, runner_up, ranks


def _forked_case(model):
    """(ids, anchor KV, full KV, d, bound): the bound lies between the anchor's margin at d and every earlier one.
    Confirmed by a run (in bf16 the verify's multi-token forward can round a near-tie apart from the sequential
    chain the search predicts with)."""
    for seed in range(60):
        ids = prompt_ids(seed, PROMPT)
        exact, _, full_kv = caches(model, ids)
        want = _chain(model, full_kv, ids, WINDOW)[0]
        for scale in (0.3, 1.0):
            anchor = perturbed(exact, scale, seed)
            tokens, margins, _, _ = _chain(model, anchor, ids, WINDOW)
            d = next((i for i in range(WINDOW - 3) if tokens[i] != want[i]), None)
            if d is None or d < 1 or min(margins[:d]) <= 1.5 * margins[d]:
                continue
            ranks = _chain(model, anchor, ids, d + 2, forced=want)[3]
            if ranks[d] != 1 or ranks[d + 1] != 0:
                continue
            bound = (margins[d] + min(margins[:d])) / 2
            with _margin(bound):
                s = run(model, StepLoad(model, ids, anchor, full_kv),
                        RunConfig(max_new_tokens=NEW, max_window=WINDOW)).stats
            if s.accepted == d and s.branch_at == d and s.branch_accepted:
                return ids, anchor, full_kv, d, bound
    raise AssertionError("no seed gives a used fork")


@pytest.fixture(scope="module")
def cases():
    out = {}
    for arch in TINY_ARCHS:
        for dt in DTYPES:
            model = make_tiny_model(arch).to(TORCH_DTYPES[dt])
            out[(arch, dt)] = (model, *_forked_case(model))
    return out


def _reference(model, full_kv, ids, stats, n=NEW, **kw):
    return decode_plain(model, full_kv, ids, n, first_forward=stats.draft_token_ids,
                        branch=(stats.branch_at, stats.branch_token_ids), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_used_fork_keeps_the_branch_drafts(cases, arch, dtype):
    model, ids, anchor, full_kv, d, bound = cases[(arch, dtype)]
    config = RunConfig(max_new_tokens=NEW, max_window=WINDOW)
    with _margin(bound):
        res = run(model, StepLoad(model, ids, anchor, full_kv), config)
    s = res.stats
    assert s.drafted == WINDOW and s.branch_at == d and s.branch_forks == 1
    assert s.branch_shared_prefix == shares_prefix(model)  # llama, qwen2, phi3: the prefix read in place
    assert len(s.branch_token_ids) == WINDOW - d  # the root, then one draft per later step
    assert len(s.branch_draft_steps) == WINDOW - d - 1
    assert s.accepted == d and s.branch_accepted >= 1  # the branch's first draft is the full code's next token
    assert res.token_ids == _reference(model, full_kv, ids, s)
    if dtype == "fp32":
        assert res.token_ids == decode_plain(model, full_kv, ids, NEW)
    # the same run without the branch keeps d drafts, and with a bound below the fork's margin there is no fork
    with _margin(0.0):
        off = run(model, StepLoad(model, ids, anchor, full_kv), config)
    with _margin(bound / 1e6):
        low = run(model, StepLoad(model, ids, anchor, full_kv), config)
    assert off.stats.branch_at is None and off.stats.branch_accepted is None
    if low.stats.branch_at is None:  # (unless a later, diverged draft is that close to a tie)
        assert low.stats.branch_token_ids == [] and low.stats.branch_draft_steps == []
    assert low.token_ids == _reference(model, full_kv, ids, low.stats)
    if dtype == "fp32":
        assert off.token_ids == low.token_ids == res.token_ids
    if dtype == "fp32":  # the timeline shows the two-chain steps and the branch's kept drafts
        from lynxkv.bench.timeline import render_png, run_timeline

        tl = run_timeline(s)
        assert tl["branch_steps"] == s.branch_draft_steps and tl["branch_accepted"] == s.branch_accepted
        assert render_png([tl]).startswith(b"\x89PNG")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_fork_that_is_not_used(cases, arch, dtype):
    """A bound above every margin forks at the first draft: the main chain is not rejected there (d > 0), so the
    branch is never verified; with the exact KV as the anchor nothing is rejected at all."""
    model, ids, anchor, full_kv, d, _ = cases[(arch, dtype)]
    for kv, kept in ((anchor, d), (full_kv, WINDOW)):
        with _margin(1e9):
            res = run(model, StepLoad(model, ids, kv, full_kv), RunConfig(max_new_tokens=NEW, max_window=WINDOW))
        s = res.stats
        assert s.branch_at == 0
        if dtype == "fp32" or kv is anchor:  # (bf16: the verify may round a near-tie of the exact anchor apart)
            assert s.branch_accepted is None and s.accepted == kept
        assert len(s.branch_token_ids) == WINDOW and len(s.branch_draft_steps) == WINDOW - 1
        assert res.token_ids == _reference(model, full_kv, ids, s)
        if dtype == "fp32":
            assert res.token_ids == decode_plain(model, full_kv, ids, NEW)


def _stop_case(cases, dtype):
    """A case whose branch's first draft and whose main draft at the fork appear nowhere else in the main chain."""
    for arch in TINY_ARCHS:
        model, ids, anchor, full_kv, d, bound = cases[(arch, dtype)]
        plain = _chain(model, anchor, ids, WINDOW)[0]
        config = dict(max_new_tokens=NEW, max_window=WINDOW)
        with _margin(bound):
            branch = run(model, StepLoad(model, ids, anchor, full_kv), RunConfig(**config)).stats.branch_token_ids
        if branch[1] not in plain and plain[d] not in plain[:d]:
            return model, ids, anchor, full_kv, d, plain, config, branch, bound
    raise AssertionError("no case fits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_stop_tokens_in_either_chain(cases, dtype):
    model, ids, anchor, full_kv, d, plain, config, branch, bound = _stop_case(cases, dtype)
    # the branch's first draft is a stop token: the branch ends there, the output at it
    with _margin(bound):
        res = run(model, StepLoad(model, ids, anchor, full_kv), RunConfig(**config, stop_token_ids=(branch[1],)))
    want = _reference(model, full_kv, ids, res.stats, stop_token_ids=(branch[1],))
    assert res.token_ids == want and res.token_ids[-1] == branch[1]
    assert res.stats.branch_token_ids == branch[:2] and res.stats.drafted == WINDOW  # the main chain went on
    # the main chain's draft at the fork is a stop token: drafting ends there, the branch has only its root
    with _margin(bound):
        res = run(model, StepLoad(model, ids, anchor, full_kv), RunConfig(**config, stop_token_ids=(plain[d],)))
    assert res.stats.drafted == d + 1 and res.stats.branch_token_ids == [branch[0]]
    assert res.stats.branch_accepted is None
    assert res.token_ids == _reference(model, full_kv, ids, res.stats, stop_token_ids=(plain[d],))
    if dtype == "fp32":
        assert res.token_ids == decode_plain(model, full_kv, ids, NEW, stop_token_ids=(plain[d],))


def test_the_branch_stops_at_max_new_tokens(cases):
    """With room for the accepted drafts, the root and one more, the branch's first draft ends the output."""
    model, ids, anchor, full_kv, d, bound = cases[("llama", "fp32")]
    with _margin(bound):
        res = run(model, StepLoad(model, ids, anchor, full_kv), RunConfig(max_new_tokens=d + 2, max_window=WINDOW))
    assert res.stats.branch_at == d and res.stats.branch_accepted == 1
    assert res.token_ids == decode_plain(model, full_kv, ids, d + 2)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_fork_grows_apart_from_its_cache(arch):
    """fork_cache: the fork and the original, grown by different tokens in one packed forward, give the rows of
    two caches built separately; the original's tokens are untouched (sliding-window models included)."""
    from lynxkv.hf.growing import fork_cache
    from lynxkv.speculative.packed import forward_packed

    model = make_tiny_model(arch)
    ids = prompt_ids(1, PROMPT)
    _, _, full_kv = caches(model, ids)
    keep, feed = first_step(ids, None)
    main = start_cache(model, full_kv, keep)
    forward_tokens(model, main, feed + [5, 6])
    fork = fork_cache(main)
    a, b = forward_packed(model, [main, fork], [[7, 8], [9]])
    forward_tokens(model, main, [10])  # the original grows on; the fork's tokens stay its own
    for tokens, rows in (([7, 8], a), ([9], b)):
        alone = start_cache(model, full_kv, keep)
        forward_tokens(model, alone, feed + [5, 6])
        assert torch.allclose(forward_tokens(model, alone, tokens), rows, atol=1e-4)
    assert int(main.get_seq_length()) == keep + 6 and int(fork.get_seq_length()) == keep + 4
    again = start_cache(model, full_kv, keep)
    ref = forward_tokens(model, again, feed + [5, 6, 9, 11])[-1]
    assert torch.allclose(forward_tokens(model, fork, [11])[-1], ref, atol=1e-4)


def test_fork_cache_refuses_layers_it_does_not_know():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from lynxkv.hf.growing import fork_cache

    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    assert fork_cache(cache) is None


class _LayeredStepLoad(StepLoad):
    """A :class:`StepLoad` that hands out the full code layer by layer: every layer is in, and the residual is
    due at once (``residual_eta`` 0) from the model's ``steps``-th forward on, so the runner stops drafting there
    to verify layer by layer."""

    def __init__(self, model, ids, anchor_kv, full_kv, steps: int):
        super().__init__(model, ids, anchor_kv, full_kv)
        self.streams_layers = True
        self._full, self._steps, self.forwards = full_kv, steps, 0
        self.asked: list[int] = []
        self.hook = model.register_forward_pre_hook(self._count)  # the test removes it

    def _count(self, _module, _args):
        self.forwards += 1

    def residual_eta(self):
        return 0.0 if self.forwards >= self._steps else None

    def layer_in(self, layer, timeout=None):
        return True

    def full_layer(self, layer):
        self.asked.append(layer)
        return self._full[layer]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_used_fork_with_the_layered_verify(cases, arch, dtype):
    model, ids, anchor, full_kv, d, bound = cases[(arch, dtype)]
    load = _LayeredStepLoad(model, ids, anchor, full_kv, steps=WINDOW - 2)
    try:
        with _margin(bound):
            res = run(model, load, RunConfig(max_new_tokens=NEW, max_window=WINDOW), timing=_LongVerify())
    finally:
        load.hook.remove()
    s = res.stats
    assert s.verify_layered and s.drafted > d + 1 and s.branch_at == d
    assert sorted(load.asked) == list(range(model.config.num_hidden_layers))  # each layer filled once
    assert s.accepted == d and s.branch_accepted >= 1  # the branch's first draft is the full code's next token
    assert res.token_ids == _reference(model, full_kv, ids, s)
    if dtype == "fp32":
        assert res.token_ids == decode_plain(model, full_kv, ids, NEW)
    # a fork at the first draft that is not used: the main chain is verified on the layers the pass filled
    load = _LayeredStepLoad(model, ids, anchor, full_kv, steps=WINDOW - 2)
    try:
        with _margin(1e9):
            res = run(model, load, RunConfig(max_new_tokens=NEW, max_window=WINDOW), timing=_LongVerify())
    finally:
        load.hook.remove()
    s = res.stats
    assert s.verify_layered and s.branch_at == 0 and s.accepted >= 1 and s.branch_accepted is None
    assert sorted(load.asked) == list(range(model.config.num_hidden_layers))
    assert res.token_ids == _reference(model, full_kv, ids, s)


@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("branchcli")
    model, model_dir, path, ids, kv = tiny_llama_cache(d)
    return model, model_dir, path, ids, d


def _cli(capsys, *args):
    code = main(["run", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_cli_run_with_a_branch_equals_the_full_code(cli_cache, capsys):
    from lynxkv.cache import open_cache

    model, model_dir, path, ids, d = cli_cache
    png = d / "t.png"
    with _margin(1e9):  # a fork at the first draft
        code, out, err = _cli(capsys, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth",
                              "8MB/s", "--json", "--timeline", str(png))
    assert code == 0, err
    s = json.loads(out)["stats"]
    assert json.loads(out)["timelines"][0]["branch_steps"] == s["branch_draft_steps"]
    assert png.read_bytes().startswith(b"\x89PNG")
    with open_cache(path) as c:
        full_kv = c.load_kv()
    want = decode_plain(model, full_kv, ids, 24, first_forward=s["draft_token_ids"],
                        branch=(s["branch_at"], s["branch_token_ids"]))
    assert json.loads(out)["token_ids"] == want
    if s["drafted"]:
        assert s["branch_at"] == 0 and s["branch_forks"] == 1
        assert len(s["branch_draft_steps"]) == len(s["branch_token_ids"]) - 1 == s["drafted"] - 1


def test_cli_a_branch_in_a_batch(cli_cache, capsys):
    """Two caches, a margin above every draft's: each request forks at its first draft and its tokens are decoding on the
    full code with its forward shapes."""
    from lynxkv.cache import open_cache

    model, model_dir, path, ids, _ = cli_cache
    with _margin(1e9):
        code, out, err = _cli(capsys, path, path, "--model", model_dir, "-n", "24", "--ignore-eos", "--bandwidth",
                              "8MB/s", "--json")
    assert code == 0, err
    with open_cache(path) as c:
        full_kv = c.load_kv()
    requests = json.loads(out)["requests"]
    assert len(requests) == 2 and any(r["stats"]["drafted"] for r in requests)
    for r in requests:
        s = r["stats"]
        assert r["token_ids"] == decode_plain(model, full_kv, ids, 24, first_forward=s["draft_token_ids"],
                                              branch=(s["branch_at"], s["branch_token_ids"]))
        if s["drafted"]:
            assert s["branch_at"] == 0 and s["branch_forks"] == 1
            assert len(s["branch_draft_steps"]) == len(s["branch_token_ids"]) - 1 == s["drafted"] - 1


def test_a_two_chain_step_abandoned_when_the_residual_lands():
    """The residual lands inside a two-chain draft forward: the step is abandoned (lynxkv.speculative.interrupt),
    the branch keeps the tokens of its whole steps, and the output is the full code's."""
    from conftest import make_tiny_llama
    from test_runner_interrupt import _LandsInForward

    model = make_tiny_llama(3, layers=3)
    ids = prompt_ids(7, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    load = _LandsInForward(model, ids, anchor_kv, full_kv, 5)
    try:
        with _margin(1e9):
            res = run(model, load, RunConfig(max_new_tokens=30, max_window=24))
    finally:
        load.close()
    s = res.stats
    assert s.drafts_abandoned == 1 and s.drafted == 4 and s.branch_at == 0
    assert len(s.branch_token_ids) == 4 and len(s.branch_draft_steps) == 3  # forwards 2-4 ran both chains
    assert res.token_ids == decode_plain(model, full_kv, ids, 30) == _reference(model, full_kv, ids, s, n=30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_forked_forward_is_two_batch1_forwards(arch, dtype):
    """forward_forked (the branch reading the draft cache's prefix in place) gives each chain the logits of its
    own batch-1 forward on a whole cache, to rounding, step after step; models it cannot run (sliding windows,
    soft-capping) say so, and the runner's branch then copies the prefix as before."""
    from transformers import DynamicCache

    from lynxkv.hf.growing import fork_cache
    from lynxkv.speculative.packed import forward_forked

    dt = dtype
    model = make_tiny_model(arch).to(TORCH_DTYPES[dt])
    config = model.config
    plain = (getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)) \
        and not getattr(config, "attn_logit_softcapping", None) \
        and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ()))
    assert shares_prefix(model) == plain
    if not plain:
        return
    ids = prompt_ids(3, PROMPT)
    _, _, full_kv = caches(model, ids)
    keep, feed = first_step(ids, None)
    main, ref_main = start_cache(model, full_kv, keep), start_cache(model, full_kv, keep)
    forward_tokens(model, main, feed)
    forward_tokens(model, ref_main, feed)
    prefix = int(main.get_seq_length())
    fork, ref_fork = DynamicCache(), fork_cache(ref_main)
    g = torch.Generator().manual_seed(0)
    tol = 1e-4 if dt == "fp32" else 5e-2
    for _ in range(6):
        t, u = (int(x) for x in torch.randint(0, 128, (2,), generator=g))
        lm, lf = forward_forked(model, main, fork, prefix, t, u)
        rf = forward_tokens(model, ref_fork, [u])[-1]  # the fork first: it copies the prefix before main grows
        rm = forward_tokens(model, ref_main, [t])[-1]
        scale = max(float(rm.abs().max()), float(rf.abs().max()))
        assert float((lm - rm).abs().max()) <= tol * scale and float((lf - rf).abs().max()) <= tol * scale
        assert int(fork.get_seq_length()) == int(ref_fork.get_seq_length()) - prefix
    assert int(main.get_seq_length()) == int(ref_main.get_seq_length()) == prefix + 6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("layered", [False, True], ids=["whole", "layered"])
def test_the_branch_in_a_batch(cases, arch, dtype, layered):
    """Two requests in one batch: the forked case with its branch (the main chain verified in one pass, then the
    branch in the request's next step) and another request. Each equals decoding on its full code with its own
    forward shapes, and in fp32 plain decoding."""
    from lynxkv.speculative import BatchRequest, run_batch

    model, ids, anchor, full_kv, d, bound = cases[(arch, dtype)]
    other_ids = prompt_ids(99, PROMPT - 7)
    _, other_anchor, other_full = caches(model, other_ids)
    hooks = []

    def load(i, a, f):
        if not layered:
            return StepLoad(model, i, a, f)
        lo = _LayeredStepLoad(model, i, a, f, steps=WINDOW - 2)  # due after the batch's tenth forward
        hooks.append(lo.hook)
        return lo

    cfg = RunConfig(max_new_tokens=NEW, max_window=WINDOW)
    try:
        with _margin(bound):
            got = run_batch(model, [BatchRequest(load(ids, anchor, full_kv), cfg, name="fork"),
                                    BatchRequest(load(other_ids, other_anchor, other_full), cfg, name="other")],
                            timing=_LongVerify())
    finally:
        for h in hooks:
            h.remove()
    fork, other = got.requests
    s = fork.stats
    assert fork.error is None and s.branch_at == d and s.branch_forks == 1 and s.verify_layered == layered
    assert len(s.branch_token_ids) == s.drafted - d and len(s.branch_draft_steps) == s.drafted - d - 1
    assert s.accepted == d and s.branch_accepted >= 1  # the branch's first draft is the full code's next token
    assert fork.token_ids == _reference(model, full_kv, ids, s)
    assert other.error is None and other.token_ids == _reference(model, other_full, other_ids, other.stats)
    if dtype == "fp32":
        assert fork.token_ids == decode_plain(model, full_kv, ids, NEW)
