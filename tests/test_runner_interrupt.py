"""The draft step under way when the residual lands is abandoned part-way (lynxkv.speculative.interrupt)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from conftest import make_tiny_llama
from lynxkv.speculative import RunConfig, decode_plain, run
from lynxkv.speculative.interrupt import DraftInterrupt, Superseded, decoder_modules
from lynxkv.speculative.model_ops import forward_tokens, start_cache
from runner_helpers import StepLoad, caches, prompt_ids, single_thread, store_prefill

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(3, layers=3)


class _LandsInForward(StepLoad):
    """A load whose residual lands inside the ``nth`` forward of the model, as its second decoder layer starts."""

    def __init__(self, model, ids, anchor_kv, full_kv, nth: int, error: Exception | None = None):
        super().__init__(model, ids, anchor_kv, full_kv)
        self._future = concurrent.futures.Future()
        self.calls = 0
        self.later_layer_calls = 0

        def land(_module, _args):
            self.calls += 1
            if self.calls == nth:
                if error is None:
                    self._future.set_result(full_kv)
                else:
                    self._future.set_exception(error)

        def count(_module, _args):
            self.later_layer_calls += 1

        layers = decoder_modules(model)
        self._handles = [layers[1].register_forward_pre_hook(land), layers[2].register_forward_pre_hook(count)]

    def close(self):
        for h in self._handles:
            h.remove()


class _BytesInThenFails(StepLoad):
    """A load whose residual bytes are all in once the ``nth`` forward reaches its second decoder layer (so that
    draft forward is ended part-way, some layers grown and the others not), and whose full code then fails to
    build (a corrupt page found at the end)."""

    def __init__(self, model, ids, anchor_kv, full_kv, nth: int):
        super().__init__(model, ids, anchor_kv, full_kv)
        self._future = concurrent.futures.Future()
        self.calls, self.bytes_in = 0, False

        def land(_module, _args):
            self.calls += 1
            if self.calls == nth:
                self.bytes_in = True
                self._future.set_exception(OSError("page 3 of layer 1 failed its checksum"))

        self._handle = decoder_modules(model)[1].register_forward_pre_hook(land)

    def residual_in(self):
        return self.bytes_in

    def close(self):
        self._handle.remove()


def _run(model, ids, anchor_kv, full_kv, nth, error=None, **config):
    load = _LandsInForward(model, ids, anchor_kv, full_kv, nth, error)
    try:
        return run(model, load, RunConfig(max_new_tokens=30, max_window=24, **config)), load
    finally:
        load.close()


def test_the_step_under_way_is_abandoned_and_the_output_is_unchanged(model):
    ids = prompt_ids(7, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    want = decode_plain(model, full_kv, ids, 30)
    res, load = _run(model, ids, anchor_kv, full_kv, 5)
    # four whole draft steps; the fifth ended at its second layer, so its third layer never ran
    assert res.stats.drafts_abandoned == 1 and res.stats.drafted == 4 and len(res.stats.draft_steps) == 4
    assert res.token_ids == want and res.verified
    verify_and_decode_forwards = load.calls - 5
    assert load.later_layer_calls == 4 + verify_and_decode_forwards


def test_an_interrupted_draft_leaves_a_whole_cache_for_the_anchor_fallback(model):
    """The residual's bytes land in the middle of a draft forward (ending it after its first layer took the
    token), then its full code fails: the anchor-only continuation is plain decoding on the anchor, as if the
    interrupted step had never run."""
    ids = prompt_ids(8, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    load = _BytesInThenFails(model, ids, anchor_kv, full_kv, 5)
    try:
        res = run(model, load, RunConfig(max_new_tokens=30, max_window=24, allow_anchor_only=True))
    finally:
        load.close()
    assert res.stats.drafts_abandoned == 1 and res.stats.drafted == 4 and not res.verified
    assert "checksum" in res.stats.residual_error
    assert res.token_ids == decode_plain(model, anchor_kv, ids, 30, first_forward=res.stats.draft_token_ids)


def test_a_failed_residual_never_interrupts_so_the_anchor_fallback_gets_a_whole_cache(model):
    ids = prompt_ids(8, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    res, load = _run(model, ids, anchor_kv, full_kv, 5, error=OSError("link down"), allow_anchor_only=True)
    assert res.stats.drafts_abandoned == 0 and res.stats.drafted == 5 and not res.verified
    # anchor-only output is plain greedy decoding on the anchor (the drafts, then one token per step)
    assert res.token_ids == decode_plain(model, anchor_kv, ids, 30, first_forward=res.stats.draft_token_ids)


def test_hooks_end_only_the_arming_threads_forward_and_are_removed_after(model):
    ids = prompt_ids(9, 20)
    _, anchor_kv, _ = caches(model, ids)
    done = concurrent.futures.Future()
    done.set_result(None)
    guard = DraftInterrupt(model, done)
    hooked = sum(len(m._forward_pre_hooks) for m in guard.modules)
    errors = []

    def other_thread():  # a forward of another request on the same model, while this thread's draft is armed
        try:
            forward_tokens(model, start_cache(model, anchor_kv, len(ids) - 1), [ids[-1]])
        except Exception as exc:  # noqa: BLE001: the assertion below reports it
            errors.append(exc)

    with guard.installed():
        guard._armed_in = threading.get_ident()  # as run() arms it around a draft forward
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        guard._armed_in = None
    assert errors == [] and guard.abandoned == 0
    assert sum(len(m._forward_pre_hooks) for m in guard.modules) == hooked
    assert len(guard.modules) == 4 and guard.modules[-1] is model.get_output_embeddings()  # 3 layers and the head
    with torch.no_grad():
        assert forward_tokens(model, start_cache(model, anchor_kv, len(ids) - 1), [ids[-1]]).shape[0] == 1


def test_every_residual_byte_in_also_ends_the_draft_forward(model):
    ids = prompt_ids(9, 20)
    _, anchor_kv, _ = caches(model, ids)
    pending = concurrent.futures.Future()  # the full code is not built yet
    guard = DraftInterrupt(model, pending, also=lambda: True)  # but its bytes are all in
    with guard.installed(), pytest.raises(Superseded):
        guard.run(forward_tokens, model, start_cache(model, anchor_kv, len(ids) - 1), [ids[-1]])
    assert guard.abandoned == 1


def _run_over_a_link(tmp_path):
    """A 6-layer tiny Llama's 400-token cache run with Lynx over a link on which its residual takes about a
    second (the anchor a bit more before it): (result, the greedy tokens on the full code)."""
    import os

    from lynxkv.bench.emulated_link import link_at
    from lynxkv.stream import open_progressive

    big = make_tiny_llama(5, layers=6, kv_heads=2, head_dim=64)
    ids = prompt_ids(5, 400)
    path = str(tmp_path / "c.lynx")
    full_kv = store_prefill(big, ids, path)
    rate = os.path.getsize(path + "r") / 1.0
    with open_progressive(path, link=link_at(rate), block_size=8 << 10, inflight=1) as load:
        res = run(big, load, RunConfig(max_new_tokens=400, max_window=400))
    return res, decode_plain(big, full_kv, ids, 400, first_forward=res.stats.draft_token_ids)


def test_while_the_runner_drafts_the_load_leaves_the_landed_layers_to_it(tmp_path, monkeypatch):
    """With the load's lowest-priority worker on (the default), a drafting runner still dequantizes the landed layers
    itself, between its steps: the load holds the worker back (``hold_early``), which would otherwise take a core
    from the draft forwards. No layer is dequantized by an early job, and the output is greedy decoding on the
    full code."""
    from lynxkv.stream.assembly import KVAssembly

    early: list[int] = []
    real = KVAssembly._early_layer

    def early_layer(self, layer):
        if not (self.urgent or self._held):  # the job dequantizes this layer
            early.append(layer)
        return real(self, layer)

    monkeypatch.setattr(KVAssembly, "_early_layer", early_layer)
    res, want = _run_over_a_link(tmp_path)
    s = res.stats
    assert s.drafted > 0 and s.verified and s.verify_layered
    assert s.layers_dequantized_between_drafts >= 2, s.layers_dequantized_between_drafts
    assert early == []
    assert res.token_ids == want


def test_the_hooks_go_on_once_per_draft_phase_and_come_off_after(model, monkeypatch):
    """Five draft forwards (the fifth ended part-way) register the hooks once, and none is left on the model."""
    first = decoder_modules(model)[0]
    registered = []
    real = first.register_forward_pre_hook
    monkeypatch.setattr(first, "register_forward_pre_hook", lambda hook: registered.append(hook) or real(hook))
    ids = prompt_ids(7, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    res, _ = _run(model, ids, anchor_kv, full_kv, 5)
    assert res.stats.drafts_abandoned == 1 and len(res.stats.draft_steps) == 4
    assert len(registered) == 1 and not first._forward_pre_hooks


def test_a_run_stopped_while_it_drafts_leaves_no_hooks(model):
    from lynxkv.speculative import stream

    first = decoder_modules(model)[0]
    ids = prompt_ids(7, 40)
    _, anchor_kv, full_kv = caches(model, ids)
    load = _LandsInForward(model, ids, anchor_kv, full_kv, 1000)  # the residual never lands in this run
    try:
        events = stream(model, load, RunConfig(max_new_tokens=30, max_window=24), provisional=True)
        assert next(e for e in events if e.kind == "draft").tokens
        assert first._forward_pre_hooks  # drafting: the interrupt's hook is on
        events.close()  # the caller stops reading mid-draft
    finally:
        load.close()
    assert not first._forward_pre_hooks
