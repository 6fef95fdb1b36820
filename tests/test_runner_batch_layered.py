"""The layered verify in a batch (lynxkv.speculative.batch): a request's verify joins a packed step while its
residual still arrives, each layer filled as it lands; a late layer gives the pass up, a failed one ends only its
request. The tokens are those of decoding on the full code either way."""

from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import make_tiny_model
from lynxkv.cache import open_cache, save_cache
from lynxkv.errors import ChecksumError
from lynxkv.hf import prefill
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import RunConfig, Timing, decode_plain
from lynxkv.speculative import BatchRequest, run_batch
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream import open_progressive
from runner_helpers import StepLoad, caches, prompt_ids, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


class _LongVerify(Timing):
    """The verify looks very long, and no measured verify says otherwise: a request starts its layered verify as
    soon as it has two draft steps. The verifies it measures are noted in ``learned`` (their busy seconds)."""

    def __init__(self):
        super().__init__()
        self.learned: list[float] = []

    def verify_estimate(self, rows, step, *, batch=False):
        return 1e4

    def note_verify(self, rows, busy, step, *, batch=False):
        self.learned.append(busy)


@pytest.fixture
def eager():
    return _LongVerify()


def _stored(tmp_path, model, name: str, tokens: int, seed: int):
    ids = prompt_ids(seed, tokens)
    kv, _ = prefill(model, torch.tensor(ids))
    path = tmp_path / f"{name}.lynx"
    save_cache(path, kv, prompt_token_ids=ids, model_fingerprint=model_fingerprint(model))
    with open_cache(path) as c:
        return ids, str(path), c.load_kv(), c.load_kv(anchor_only=True)


def _rate(path: str, seconds: float) -> float:
    """Bytes per second at which the whole cache (anchor + residual) takes about ``seconds``."""
    return (os.path.getsize(path) + os.path.getsize(path + "r")) / seconds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_requests_verify_layer_by_layer_in_a_batch(tmp_path, eager, dtype):
    """Three requests over their own emulated links: the two that draft verify while their residuals arrive
    (their verify started before the last layer was in) and every request's tokens are greedy decoding on its
    full code with the drafts it verified; the third, which does not draft, is untouched. The second arrives
    after the first's residual: a layered pass that starts this early (``eager``) waits inside the shared
    forward, and a request drafting beside it would get few draft steps to judge a step by."""
    model = make_tiny_model("llama", 3).to(dtype)
    stored = [_stored(tmp_path, model, f"c{i}", 120 + 40 * i, i) for i in range(3)]
    cfgs = [RunConfig(max_new_tokens=20),
            RunConfig(max_new_tokens=20),
            RunConfig(max_new_tokens=12, speculate=False)]
    reqs = [BatchRequest(lambda p=path: open_progressive(p, link=link_at(_rate(p, 1.0))), cfg, name=str(i),
                         arrival_s=1.5 if i == 1 else 0.0)
            for i, ((_, path, _, _), cfg) in enumerate(zip(stored, cfgs))]
    got = run_batch(model, reqs, timing=eager)
    for (ids, _, full_kv, _), cfg, r in zip(stored, cfgs, got.requests):
        s = r.stats
        assert r.error is None and r.verified
        assert r.token_ids == decode_plain(model, full_kv, ids, cfg.max_new_tokens, first_forward=s.draft_token_ids)
    for r in got.requests[:2]:
        s = r.stats
        assert s.drafted >= 2 and s.verify_layered and not s.verify_layered_abandoned
        assert s.verify_start_s < s.residual_ready_s <= s.verify_end_s
    assert not got.requests[2].stats.verify_layered and got.requests[2].stats.drafted == 0
    assert not model.model.layers[0]._forward_pre_hooks  # the passes' hooks are gone


class _LayeredLoad(StepLoad):
    """A :class:`StepLoad` that hands out its full code layer by layer, its residual due at once (ETA 0) from its
    third draft on. ``late`` from that layer on says a layer is not in yet; ``broken`` from that layer on raises
    the load's failure; the whole residual still lands when the runner asks for it (or fails, with ``error``)."""

    def __init__(self, model, ids, anchor_kv, full_kv, *, late=None, broken=None, short=None, error=None,
                 slow=None):
        super().__init__(model, ids, anchor_kv, full_kv, error=error)
        self.streams_layers = True
        self._full, self.late, self.broken, self.short = full_kv, late, broken, short
        self.slow = dict(slow or {})  # layer -> seconds its residual takes to come in once asked for
        self.asked: list[int] = []
        self.etas = 0
        self.was_late = False  # a layer was late: the residual's estimate is gone (as a stalled link's would be)
        self.given_up = 0  # calls of layers_given_up

    def residual_eta(self):
        self.etas += 1
        return 0.0 if self.etas > 3 and not self.was_late else None

    def layer_in(self, layer, timeout=None):
        if self.broken is not None and layer >= self.broken:
            raise ChecksumError(f"residual layer {layer}: CRC mismatch")
        self.was_late |= self.late is not None and layer >= self.late
        if layer in self.slow:
            time.sleep(self.slow.pop(layer))
        return self.late is None or layer < self.late

    def layers_given_up(self):
        self.given_up += 1

    def full_layer(self, layer):
        self.asked.append(layer)
        k, v = self._full[layer]
        if self.short is not None and layer >= self.short:  # a load that hands out too few tokens
            return k[:, :-3], v[:, :-3]
        return k, v


def _pair(model):
    """Two requests' (ids, anchor KV, full KV) of different lengths."""
    return [(ids, a, f) for ids in (prompt_ids(7, 40), prompt_ids(8, 25)) for _, a, f in [caches(model, ids)]]


def test_a_late_layer_gives_the_pass_up_and_the_request_verifies_after_its_residual(tiny_model, eager):
    model = tiny_model
    (ids0, a0, f0), (ids1, a1, f1) = _pair(model)
    cfg = RunConfig(max_new_tokens=14, max_window=8)
    late = _LayeredLoad(model, ids0, a0, f0, late=1)
    got = run_batch(model, [BatchRequest(late, cfg, name="late"), BatchRequest(StepLoad(model, ids1, a1, f1), cfg)],
                    timing=eager)
    r, other = got.requests
    s = r.stats
    assert r.error is None and r.verified
    assert s.verify_layered_abandoned and not s.verify_layered  # the layered pass was dropped, then a whole verify
    assert s.verify_waited_s is None  # the verify that counts did not wait for layers
    assert s.drafted == 8  # it went back to drafting, to its window's end, as without the pass
    assert late.asked == [0]  # no layer was filled after the late one
    assert late.given_up == 1  # the load was told, so it builds the rest of the full code early again
    assert r.token_ids == decode_plain(model, f0, ids0, 14, first_forward=s.draft_token_ids)
    assert other.error is None and other.token_ids == decode_plain(model, f1, ids1, 14,
                                                                   first_forward=other.stats.draft_token_ids)


def test_a_step_that_waits_for_a_layer_is_no_draft_step_and_no_verify_cost(tiny_model, eager):
    """A layer that comes in late, inside the pass's patience, holds up the whole packed step. That step measures
    neither a draft step of the request drafting beside the pass (its guard and its own pass judge by its steps)
    nor the verify's cost, which the batch learns for later passes: the wait is left out of both."""
    model = tiny_model
    (ids0, a0, f0), (ids1, a1, f1) = _pair(model)
    cfg = RunConfig(max_new_tokens=14, max_window=8)
    slow = _LayeredLoad(model, ids0, a0, f0, slow={1: 0.4})
    got = run_batch(model, [BatchRequest(slow, cfg, name="slow"),
                            BatchRequest(StepLoad(model, ids1, a1, f1), cfg, name="beside")], timing=eager)
    r, beside = got.requests
    assert r.error is None and r.stats.verify_layered and r.stats.verify_waited_s >= 0.4
    assert r.token_ids == decode_plain(model, f0, ids0, 14, first_forward=r.stats.draft_token_ids)
    assert len(eager.learned) == 1 and eager.learned[0] < 0.2  # the verify's own compute, not the 0.4 s it waited
    held = [e - s for s, e in beside.stats.draft_steps]
    assert max(held) >= 0.4  # the request beside drafted in the step that waited ...
    assert beside.stats.draft_step_s < 0.2  # ... which its step time leaves out
    assert beside.error is None and beside.token_ids == decode_plain(model, f1, ids1, 14,
                                                                     first_forward=beside.stats.draft_token_ids)


@pytest.mark.parametrize("anchor_only", [False, True], ids=["error", "anchor-only"])
def test_a_layer_that_fails_during_the_pass_ends_only_its_request(tiny_model, eager, anchor_only):
    model = tiny_model
    (ids0, a0, f0), (ids1, a1, f1) = _pair(model)
    cfg = RunConfig(max_new_tokens=14, max_window=8, allow_anchor_only=anchor_only)
    bad = _LayeredLoad(model, ids0, a0, f0, broken=1, error=ChecksumError("residual layer 1: CRC mismatch"))
    got = run_batch(model, [BatchRequest(bad, cfg, name="bad"), BatchRequest(StepLoad(model, ids1, a1, f1), cfg)],
                    timing=eager)
    r, other = got.requests
    if anchor_only:  # its drafts, then plain decoding on its anchor: what decoding on the anchor gives
        assert r.error is None and not r.verified and "CRC mismatch" in r.stats.residual_error
        assert r.stats.drafted >= 2 and r.token_ids == decode_plain(model, a0, ids0, 14)
    else:
        assert r.token_ids == [] and "CRC mismatch" in r.error and "anchor-only" in r.error
    assert other.error is None and other.verified
    assert other.token_ids == decode_plain(model, f1, ids1, 14, first_forward=other.stats.draft_token_ids)


def test_a_full_code_layer_of_the_wrong_shape_ends_only_its_request(tiny_model, eager):
    """A load that hands out a layer of the wrong shape during the layered pass: that request ends with one clear
    error (no failed forward for the others), the other request's tokens are decoding on its full code."""
    model = tiny_model
    (ids0, a0, f0), (ids1, a1, f1) = _pair(model)
    cfg = RunConfig(max_new_tokens=14, max_window=8)
    got = run_batch(model, [BatchRequest(_LayeredLoad(model, ids0, a0, f0, short=1), cfg, name="short"),
                            BatchRequest(StepLoad(model, ids1, a1, f1), cfg)], timing=eager)
    r, other = got.requests
    assert r.token_ids == [] and "layer 1 keys have shape" in r.error and "anchor-only" in r.error
    assert other.error is None and other.token_ids == decode_plain(model, f1, ids1, 14,
                                                                   first_forward=other.stats.draft_token_ids)
