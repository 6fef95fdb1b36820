"""The batched runner: every request's tokens are those of its batch-1 run (greedy and seeded sampling), across
architectures and dtypes; requests join and leave; one request's bad residual ends that request only."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_ARCHS, make_tiny_model
from runner_helpers import StepLoad, caches, prompt_ids, single_thread
from lynxkv.cache.loading import PreparedLoad
from lynxkv.errors import ChecksumError
from lynxkv.hf.models import model_fingerprint
from lynxkv.speculative import RunConfig, SamplingParams, decode_plain, run
from lynxkv.speculative import BatchRequest, run_batch

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

LENGTHS = (7, 12, 19, 26, 33, 41, 48, 60, 23)  # 9 requests of different lengths
WINDOWS = (0, 1, 3, 5, 8, 2, 12, 4, 6)  # drafts before each request's residual lands


def _setup(model, n=len(LENGTHS), scale=None):
    out = []
    for i, length in enumerate(LENGTHS[:n]):
        ids = prompt_ids(i, length)
        kv, anchor, full = caches(model, ids)
        out.append((ids, kv, anchor, full))
    return out


def _configs(sampled: bool, n: int):
    params = SamplingParams(temperature=0.9, top_p=0.95) if sampled else SamplingParams()
    return [RunConfig(max_new_tokens=6 + 2 * i, max_window=WINDOWS[i], sampling=params, seed=100 + i) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_batch_equals_batch1(arch, dtype, sampled):
    model = make_tiny_model(arch).to(dtype)
    data = _setup(model)
    cfgs = _configs(sampled, len(data))
    # The residual of each lands when its window is full (StepLoad), so a request drafts exactly as many tokens in
    # the batch as alone: the same forward shapes, the same draws from its generator.
    batch = run_batch(model, [BatchRequest(StepLoad(model, ids, a, f), cfg, name=f"r{i}")
                              for i, ((ids, _, a, f), cfg) in enumerate(zip(data, cfgs))])
    assert max(s[2] for s in batch.steps) == len(data)  # they really shared forwards
    for i, ((ids, _, a, f), cfg, got) in enumerate(zip(data, cfgs, batch.requests)):
        alone = run(model, StepLoad(model, ids, a, f), cfg)
        assert got.error is None, got.error
        assert got.token_ids == alone.token_ids, f"request {i}"
        assert got.stats.drafted == alone.stats.drafted == min(WINDOWS[i], cfg.max_new_tokens)
        assert got.stats.accepted == alone.stats.accepted
        if not sampled:  # and both are greedy decoding on the full code, with the verify's forward shapes
            ref = decode_plain(model, f, ids, cfg.max_new_tokens, first_forward=got.stats.draft_token_ids)
            assert got.token_ids == ref
    # a request that drafted and one that did not both appear, and some drafts were rejected somewhere
    assert any(r.stats.drafted == 0 for r in batch.requests) and any(r.stats.drafted for r in batch.requests)


def test_new_prompt_tokens_in_a_batch(tiny_model):
    model = tiny_model
    data = _setup(model, 8)
    reqs, alone = [], []
    for i, (ids, _, a, f) in enumerate(data):
        new = prompt_ids(50 + i, 1 + i % 4)
        cfg = RunConfig(max_new_tokens=12, max_window=WINDOWS[i])
        reqs.append(BatchRequest(StepLoad(model, ids, a, f), cfg, new_token_ids=new))
        alone.append(run(model, StepLoad(model, ids, a, f), cfg, new_token_ids=new).token_ids)
    got = run_batch(model, reqs)
    assert [r.token_ids for r in got.requests] == alone


def test_join_and_leave_over_time(tiny_model):
    """Requests arrive while others decode, with residuals landing at their own times; each leaves when done."""
    model = tiny_model
    fp = model_fingerprint(model)
    data = _setup(model, 8)
    reqs = []
    for i, (ids, _, a, f) in enumerate(data):
        load = lambda ids=ids, a=a, f=f, i=i: PreparedLoad(a, f, residual_delay=0.02 * (i % 3), prompt_token_ids=ids,
                                                            model_fingerprint=fp)
        reqs.append(BatchRequest(load, RunConfig(max_new_tokens=20 + 5 * (i % 3)),
                                 arrival_s=0.03 * i))
    got = run_batch(model, reqs)
    for (ids, _, a, f), r, spec in zip(data, got.requests, reqs):
        assert r.error is None
        ref = decode_plain(model, f, ids, spec.config.max_new_tokens, first_forward=r.stats.draft_token_ids)
        assert r.token_ids == ref and len(r.token_ids) == spec.config.max_new_tokens
    sizes = [s[2] for s in got.steps]
    assert min(sizes) < max(sizes)  # the batch grew and shrank
    assert got.aggregate()["tokens"] == sum(len(r.token_ids) for r in got.requests)


@pytest.mark.parametrize("anchor_only", [False, True], ids=["error", "anchor-only"])
def test_bad_residual_ends_only_its_request(tiny_model, anchor_only):
    model = tiny_model
    data = _setup(model, 8)
    reqs = []
    for i, (ids, _, a, f) in enumerate(data):
        error = ChecksumError("residual page 3: CRC mismatch") if i == 2 else None
        cfg = RunConfig(max_new_tokens=16, max_window=4, allow_anchor_only=anchor_only)
        reqs.append(BatchRequest(StepLoad(model, ids, a, f, error=error), cfg))
    got = run_batch(model, reqs)
    for i, ((ids, _, a, f), r) in enumerate(zip(data, got.requests)):
        if i == 2:
            if anchor_only:
                assert r.error is None and not r.verified and "CRC mismatch" in r.stats.residual_error
                assert r.token_ids == run(model, StepLoad(model, ids, a, f, error=ChecksumError("x")),
                                          reqs[i].config).token_ids
            else:
                assert r.token_ids == [] and "CRC mismatch" in r.error and "anchor-only" in r.error
            continue
        assert r.error is None and r.verified
        assert r.token_ids == decode_plain(model, f, ids, 16, first_forward=r.stats.draft_token_ids)


class _BadClose(StepLoad):
    """A load whose close errs (a file or a socket that fails as it is closed)."""

    def close(self):
        raise OSError("close: connection reset by peer")


def test_a_load_that_fails_to_close_ends_nothing(tiny_model):
    """Closing a load its request is done with may fail: the request keeps what it has (its tokens, or its own
    error), the error is kept in its load's timeline, and the other requests go on."""
    model = tiny_model
    data = _setup(model, 3)
    cfg = RunConfig(max_new_tokens=10, max_window=3)
    reqs = [BatchRequest(_BadClose(model, ids, a, f, error=ChecksumError("residual page 1: CRC mismatch")
                                   if i == 1 else None), cfg) for i, (ids, _, a, f) in enumerate(data)]
    got = run_batch(model, reqs)
    for i, ((ids, _, a, f), r) in enumerate(zip(data, got.requests)):
        assert "connection reset" in r.stats.load["extra"]["close_error"]
        if i == 1:
            assert "CRC mismatch" in r.error
            continue
        assert r.error is None and r.verified
        assert r.token_ids == decode_plain(model, f, ids, 10, first_forward=r.stats.draft_token_ids)


def test_foreign_cache_ends_only_its_request(tiny_model):
    model = tiny_model
    data = _setup(model, 3)
    reqs = [BatchRequest(StepLoad(model, ids, a, f, fingerprint="0" * 16 if i == 1 else None),
                         RunConfig(max_new_tokens=8)) for i, (ids, _, a, f) in enumerate(data)]
    got = run_batch(model, reqs)
    assert "another model" in got.requests[1].error and got.requests[1].token_ids == []
    assert all(got.requests[i].error is None and len(got.requests[i].token_ids) == 8 for i in (0, 2))


def test_32_staggered_requests_release_what_they_finish_with(tiny_model):
    """32 requests arriving over time, at most 8 in a forward: all finish with their tokens, and a finished
    request's caches are let go while the others still run (memory follows the live requests, not all of them)."""
    import gc
    import weakref

    model = tiny_model
    fp = model_fingerprint(model)
    refs, alive_after_done = {}, []
    reqs = []
    for i in range(32):
        ids = prompt_ids(200 + i, 10 + (7 * i) % 40)

        def open_load(i=i, ids=ids):
            _, a, f = caches(model, ids)
            refs[i] = weakref.ref(f[0][0])  # the full code's first key tensor: held only by the load and the run
            return PreparedLoad(a, f, residual_delay=0.01 * (i % 4), prompt_token_ids=ids, model_fingerprint=fp)
        reqs.append(BatchRequest(open_load, RunConfig(max_new_tokens=6 + i % 5),
                                 arrival_s=0.01 * i, name=str(i)))

    def on_step(results):
        # at most 8 requests are open at once: a load is opened only when there is room for it
        assert len(refs) - sum(1 for r in results if r.error or len(r.token_ids) == reqs[int(r.name)].config.max_new_tokens) <= 8
        gc.collect()
        for r in results:
            i = int(r.name)
            if len(r.token_ids) == reqs[i].config.max_new_tokens and i in refs and refs[i]() is not None:
                alive_after_done.append(i)

    got = run_batch(model, reqs, max_batch=8, on_step=on_step)
    assert got.aggregate()["max_batch"] == 8 and got.aggregate()["failed"] == 0
    assert not alive_after_done
    for r, spec in zip(got.requests, reqs):
        full = caches(model, prompt_ids(200 + int(r.name), 10 + (7 * int(r.name)) % 40))[2]
        ids = prompt_ids(200 + int(r.name), 10 + (7 * int(r.name)) % 40)
        assert r.token_ids == decode_plain(model, full, ids, spec.config.max_new_tokens,
                                           first_forward=r.stats.draft_token_ids)


class _BytesIn(PreparedLoad):
    """A load whose residual bytes are all in (ETA 0) while its full code is still being built, for a while."""

    def residual_eta(self):
        return 0.0


def test_a_request_whose_residual_is_due_stops_drafting_while_the_others_go_on(tiny_model):
    """The ETA guard in a batch: a request whose residual is due within half a draft step sits the steps out
    (after the two draft steps that measure it: the first is not a typical one) until its full code is in, while
    another request decodes on. Its tokens are decoding on its full code."""
    model = tiny_model
    fp = model_fingerprint(model)
    data = _setup(model, 2)
    cfg = RunConfig(max_new_tokens=40, max_window=30)
    reqs = [BatchRequest(PreparedLoad(data[0][2], data[0][3], prompt_token_ids=data[0][0], model_fingerprint=fp),
                         cfg, name="decoding"),
            BatchRequest(_BytesIn(data[1][2], data[1][3], residual_delay=1.0, prompt_token_ids=data[1][0],
                                  model_fingerprint=fp), cfg, name="due")]
    got = run_batch(model, reqs)
    due = got.requests[1]
    assert due.stats.drafted == 2 and due.stats.waited_on_eta
    held = (due.stats.draft_steps[-1][1], due.stats.verify_start_s)  # both arrived at 0: the batch's clock
    assert any(held[0] <= start and end <= held[1] and n == 1 for start, end, n, _ in got.steps)  # the other
    for (ids, _, a, f), r in zip(data, got.requests):
        assert r.error is None and r.verified
        assert r.token_ids == decode_plain(model, f, ids, 40, first_forward=r.stats.draft_token_ids)


def test_a_verified_request_decodes_without_its_loads_copies(tiny_model):
    """Once a request's cache holds its full code, the request lets its load go: while it decodes on, neither its
    load's anchor KV nor (after the verify forward moved the cache into a buffer of its own) its full code is
    alive any more, so a decoding request holds one copy of its KV, not three."""
    import weakref

    model = tiny_model
    fp = model_fingerprint(model)
    data = _setup(model, 3)
    refs = {}

    def opener(i):
        def open_load():
            _, _, a, f = data[i]
            a = [(k.clone(), v.clone()) for k, v in a]  # tensors only this load holds
            f = [(k.clone(), v.clone()) for k, v in f]
            refs[i] = (weakref.ref(a[0][0]), weakref.ref(f[0][0]))
            return PreparedLoad(a, f, residual_delay=0.02 * i, prompt_token_ids=data[i][0], model_fingerprint=fp)
        return open_load

    n = 24
    reqs = [BatchRequest(opener(i), RunConfig(max_new_tokens=n, max_window=4), name=str(i))
            for i in range(3)]
    checked = []

    def on_step(results):
        for r in results:
            i = int(r.name)
            if r.stats.verify_end_s is not None and 0 < len(r.token_ids) < n:  # verified, still decoding
                anchor, full = refs[i]
                checked.append(i)
                assert anchor() is None and full() is None, f"request {i} still holds its load's KV"

    got = run_batch(model, reqs, on_step=on_step)
    assert set(checked) == {0, 1, 2}
    for (ids, _, a, f), r in zip(data, got.requests):
        assert r.verified and r.token_ids == decode_plain(model, f, ids, n, first_forward=r.stats.draft_token_ids)
        assert r.stats.load["residual_ready_s"] is not None  # the load's timeline was kept


class _BusyTimeline(PreparedLoad):
    """A load whose workers keep adding to its timeline's ``extra`` while the batch runs (a progressive load's
    parser and consumer threads do, a few times per load)."""

    def __init__(self, *args, **kwargs):
        import threading

        super().__init__(*args, **kwargs)
        self._timeline.extra.update({f"k{i}": i for i in range(2000)})
        self._stop = threading.Event()
        threading.Thread(target=self._churn, daemon=True).start()

    def _churn(self):
        i = 0
        while not self._stop.is_set():
            self._timeline.extra.pop(f"k{i}", None)
            self._timeline.extra[f"k{i + 2000}"] = i
            i += 1

    def close(self):
        super().close()
        self._stop.set()


def test_a_timeline_still_growing_is_read_safely(tiny_model):
    """The batch reads a load's timeline while the load's own threads may still add to it: every step (for the
    progress display) it must not, and when it does (once, as the request lets the load go) it copies ``extra`` in
    one step, so no 'dictionary changed size during iteration' ends the batch."""
    model = tiny_model
    fp = model_fingerprint(model)
    data = _setup(model, 2)
    reqs = [BatchRequest(_BusyTimeline(a, f, residual_delay=0.05, prompt_token_ids=ids, model_fingerprint=fp),
                         RunConfig(max_new_tokens=30)) for ids, _, a, f in data]
    got = run_batch(model, reqs, on_step=lambda results: None)
    for (ids, _, a, f), r in zip(data, got.requests):
        assert r.error is None and len(r.stats.load["extra"]) >= 1999  # taken between a pop and its insert, or not
        assert r.token_ids == decode_plain(model, f, ids, 30, first_forward=r.stats.draft_token_ids)
