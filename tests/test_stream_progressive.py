"""The progressive reader on local and memory:// tiers: order of events, exact KV, the 1 Gbps link, faults."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from fixtures_s3 import cache_bytes, kv_equal, random_kv, synthetic_cache_bytes, write_pair

from lynxkv.cache import open_cache
from lynxkv.errors import ChecksumError, FormatError, LynxError
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream import open_progressive
from lynxkv.bench.emulated_link import EmulatedLink
from lynxkv.stream.progressive import ProgressiveLoad
from lynxkv.storage import RetryPolicy

FAST_RETRY = RetryPolicy(attempts=3, base=0.01, stall_timeout=0.3)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prog")
    kv = random_kv(layers=3, heads=2, tokens=600, dim=16)  # 3 pages per layer, the last one short
    anchor, residual = cache_bytes(kv)
    path = write_pair(d, anchor, residual)
    with open_cache(path) as c:
        ref = (c.load_kv(anchor_only=True), c.load_kv())
    return d, path, anchor, residual, ref


def _kinds(events):
    return [e.kind for e in events]


def test_anchor_then_residual_exact_kv_and_event_order(cache_dir, transport):
    _, path, anchor, residual, (ref_anchor, ref_full) = cache_dir
    seen = []
    load = open_progressive(path, on_event=seen.append, **transport)
    try:
        assert kv_equal(load.wait_anchor(30), ref_anchor)
        assert kv_equal(load.residual.result(30), ref_full)
        events = list(load.events(timeout=30))
    finally:
        load.close()
    assert _kinds(events) == _kinds(seen)
    kinds = _kinds(events)
    n = 3 * 3
    assert kinds == ["anchor_page"] * n + ["anchor_ready"] + ["residual_page"] * n + ["residual_ready"]
    order = [(e.layer, e.page) for e in events if e.kind == "anchor_page"]
    assert order == [(layer, p) for layer in range(3) for p in range(3)]
    assert order == [(e.layer, e.page) for e in events if e.kind == "residual_page"]
    tl = load.timeline
    assert tl.anchor_bytes == len(anchor) and tl.residual_bytes == len(residual)
    assert 0 < tl.anchor_ready_s <= tl.residual_ready_s and tl.residual_failed is None
    assert load.prompt_token_ids == [1, 2, 3] and load.model_fingerprint == "0" * 32
    assert load.residual_eta() == 0.0


def test_single_file_cache(tmp_path, cache_dir, transport):
    *_, (ref_anchor, ref_full) = cache_dir
    anchor, _ = cache_bytes(random_kv(layers=3, heads=2, tokens=600, dim=16), single_file=True)
    path = write_pair(tmp_path, anchor, None)
    with open_progressive(path, **transport) as load:
        assert kv_equal(load.wait_anchor(30), ref_anchor)
        assert kv_equal(load.residual.result(30), ref_full)
        assert load.timeline.anchor_bytes + load.timeline.residual_bytes == len(anchor)


def test_memory_tier_and_residual_override(cache_dir):
    from lynxkv.storage import write_atomic

    _, _, anchor, residual, (_, ref_full) = cache_dir
    write_atomic("memory://hot/x.lynx", anchor)
    write_atomic("memory://cold/elsewhere.lynxr", residual)
    with open_progressive("memory://hot/x.lynx", residual="memory://cold/elsewhere.lynxr") as load:
        assert kv_equal(load.residual.result(30), ref_full)
        assert load.residual_url == "memory://cold/elsewhere.lynxr"


@pytest.mark.timing
def test_one_gbps_link_anchor_first_and_measured_rate(tmp_path):
    """A 4+4 cache of about 40 MB under an emulated 1 Gbit/s link (2 ms latency): the anchor is complete at
    <= 0.6 x the residual-ready time and both streams together run within 10 % of the configured rate."""
    import gc

    anchor, residual = synthetic_cache_bytes(layers=4, heads=8, tokens=4096, dim=128)
    path = write_pair(tmp_path, anchor, residual)
    # The interpreter's full collection, which a long test session can trigger at any point, stops every thread for
    # a tenth of a second or more with thousands of tests collected: not the link's to measure.
    gc.collect()
    gc.disable()
    try:
        with open_progressive(path, link=link_at("1Gbps", "2ms"), decode=False) as load:
            load.residual.result(60)
            tl = load.timeline
    finally:
        gc.enable()
    link = tl.extra["link"]
    total = len(anchor) + len(residual)
    assert link["anchor"]["bytes"] + link["residual"]["bytes"] == total
    assert tl.anchor_ready_s <= 0.6 * tl.residual_ready_s, (tl.anchor_ready_s, tl.residual_ready_s)
    assert link["total"]["rate"] == pytest.approx(125e6, rel=0.10)
    assert link["residual"]["first_s"] >= link["anchor"]["last_s"] - 0.01  # strict priority


@pytest.mark.parametrize("single", [False, True], ids=["two-files", "single-file"])
def test_residual_pages_are_read_once_the_anchor_is_ready(tmp_path, monkeypatch, single):
    """The residual's pages are parsed (read from the stream, CRC-checked) only once the anchor is dequantized, so
    that with no link limit they take no CPU from it; the load still ends with the full code, equal to
    load_kv's."""
    from lynxkv.format import constants as c
    from lynxkv.format.reader import PageReader
    from lynxkv.stream import progressive

    anchor, residual = cache_bytes(random_kv(layers=3, dim=64), single_file=single)
    path = write_pair(tmp_path, anchor, residual)
    seen = []
    real = PageReader.pages

    def pages(self, kind, *args, **kwargs):
        if kind == c.SEGMENT_RESIDUAL:
            seen.extend(load._anchor_kv is not None for load in progressive._LIVE if load._reader is self)
        return real(self, kind, *args, **kwargs)

    monkeypatch.setattr(PageReader, "pages", pages)
    with open_progressive(str(path)) as load:
        full = load.residual.result(60)
    assert seen == [True], seen
    with open_cache(str(path)) as cache:
        assert kv_equal(full, cache.load_kv(dtype=torch.float32))


@pytest.mark.timing
def test_the_full_code_is_dequantized_layer_by_layer_as_the_residual_arrives(tmp_path):
    """Behind a link, a layer's full code is dequantized once its residual is in, before the rest of the residual
    has arrived (on a worker of the lowest priority: on a busy machine it may wait), so little is left to do after
    the last byte. The full code equals load_kv's."""
    anchor, residual = cache_bytes(random_kv(layers=6, heads=4, tokens=1024, dim=64))
    path = write_pair(tmp_path, anchor, residual)
    # The residual takes about 1.6 s, in 64 KiB blocks read one at a time: its layers arrive in order (with 1 MiB
    # blocks, four in flight, its two blocks shared the link and both came in at the end).
    with open_progressive(str(path), link=link_at("8Mbps"), block_size=64 << 10, inflight=1) as load:
        load.wait_anchor(60)  # (not layer_in: a caller asking for layers takes them itself)
        early = 0
        while load.timeline.extra["residual_arrived_s"] is None and not load.residual.done():
            early = sum(load._kv._done)  # layers with their full code while bytes are still to come
            time.sleep(0.005)
        full = load.residual.result(60)
    assert early >= 3, early
    with open_cache(str(path)) as cache:
        assert kv_equal(full, cache.load_kv(dtype=torch.float32))


@pytest.mark.timing
def test_a_caller_that_gives_its_layers_up_has_them_dequantized_early_again(tmp_path):
    """A caller of ``layer_in`` (a layered verify) takes the layers itself, so the load stops dequantizing them
    early, and ``layer_in(i, 0)`` answers without waiting. Once the caller gives them up (``layers_given_up``: a
    pass given up in a batch), the layers in that nobody began and every later one are dequantized early again,
    before the rest of the residual has arrived. The full code equals load_kv's."""
    anchor, residual = cache_bytes(random_kv(layers=6, heads=4, tokens=1024, dim=64))
    path = write_pair(tmp_path, anchor, residual)
    with open_progressive(str(path), link=link_at("8Mbps"), block_size=64 << 10, inflight=1) as load:
        load.wait_anchor(60)
        assert load.layer_in(0, 60)  # from here on the caller takes the layers
        t = time.perf_counter()
        assert not load.layer_in(5, 0)  # the last layer comes last
        asked_at_once = time.perf_counter() - t
        assert load._kv._in[2].wait(60)
        time.sleep(0.05)
        taken_by_the_caller = list(load._kv._done[:3])  # in, but left to the caller
        load.layers_given_up()
        early = 0
        while load.timeline.extra["residual_arrived_s"] is None and not load.residual.done():
            early = sum(load._kv._done)
            time.sleep(0.005)
        full = load.residual.result(60)
    assert asked_at_once < 0.04, asked_at_once  # (it waited 50-100 ms before)
    assert taken_by_the_caller == [False] * 3
    assert early >= 3, early
    with open_cache(str(path)) as cache:
        assert kv_equal(full, cache.load_kv(dtype=torch.float32))


@pytest.mark.timing
def test_a_caller_that_holds_the_early_worker_takes_the_landed_layers_itself_until_it_lets_go(tmp_path):
    """``hold_early(True)`` (a runner drafting, which dequantizes the landed layers between its steps): the load's
    early worker begins no layer, ``dequantize_landed`` takes them; ``hold_early(False)``: the worker takes those
    in and those to come again, before the rest of the residual has arrived. The full code equals load_kv's."""
    anchor, residual = cache_bytes(random_kv(layers=6, heads=4, tokens=1024, dim=64))
    path = write_pair(tmp_path, anchor, residual)
    with open_progressive(str(path), link=link_at("8Mbps"), block_size=64 << 10, inflight=1) as load:
        load.wait_anchor(60)
        load.hold_early(True)
        assert load._kv._in[1].wait(60)
        time.sleep(0.05)
        held = list(load._kv._done[:2])  # in, and left to the caller
        taken = load.dequantize_landed()
        load.hold_early(False)
        early = 0
        while load.timeline.extra["residual_arrived_s"] is None and not load.residual.done():
            early = sum(load._kv._done) - taken
            time.sleep(0.005)
        full = load.residual.result(60)
    assert held == [False, False]
    assert taken >= 2, taken
    assert early >= 2, early
    with open_cache(str(path)) as cache:
        assert kv_equal(full, cache.load_kv(dtype=torch.float32))


def test_prefault_maps_the_full_code_and_never_writes_over_a_dequantized_layer(tmp_path):
    """``KVAssembly.prefault`` (run while the anchor is on its way) touches the full code's tensors layer by layer,
    stops when told, skips a layer already dequantized (its values stay), and leaves the anchor's tensors alone."""
    from lynxkv.stream.assembly import KVAssembly

    path = write_pair(tmp_path, *cache_bytes(random_kv(layers=4, heads=2, tokens=300, dim=16)))
    with open_cache(str(path)) as cache:
        header = cache.header
    kv = KVAssembly(header, torch.float32, room=8)
    for k, v in kv.full:
        k.fill_(7.0)
        v.fill_(7.0)
    kv.anchor[0][0].fill_(3.0)
    kv._done[1] = True  # layer 1 was dequantized: its values are kept
    assert kv.prefault(lambda: False) == 3
    page = 4096 // 4
    for layer, (k, v) in enumerate(kv.full):
        for t in (k, v):
            touched = t[0].reshape(-1)[::page]
            assert bool((touched == 7.0).all()) if layer == 1 else bool((touched == 0).all()), layer
            assert int((t != 7.0).sum()) == (0 if layer == 1 else t.shape[0] * touched.numel()), layer
    assert bool((kv.anchor[0][0] == 3.0).all())
    calls = []
    assert kv.prefault(lambda: calls.append(1) or len(calls) > 2) == 1  # told to stop before its third layer


def test_letting_the_layers_go_after_the_early_worker_was_shut_down_starts_nothing():
    """``hold(False)`` or ``relax()`` once the load has shut its early worker down (the residual all in, its
    unbegun early jobs cancelled) starts no job and raises nothing (a cancelled job has no outcome to ask)."""
    from concurrent.futures import Future

    from lynxkv.stream.assembly import KVAssembly

    cancelled = Future()
    cancelled.cancel()
    kv = object.__new__(KVAssembly)
    kv.__dict__.update(_early=None, _early_jobs={0: cancelled}, _early_lock=threading.Lock(),
                       _closed_early=True, _done=[False], _jobs={0: "job 0"}, urgent=False, _held=True)
    kv.hold(False)
    kv.relax()
    assert kv._early is None and kv._early_jobs == {0: cancelled}


class _TimedOutJustThen:
    """A header event whose first wait answers 'timed out' once the whole anchor is in: the header came in just as
    the residual parser's wait ran out, and the anchor finished before the parser looked again."""

    def __init__(self, real: threading.Event, anchor_done: threading.Event):
        self._real, self._anchor_done, self._first = real, anchor_done, True

    def wait(self, timeout=None):
        if self._first:
            self._first = False
            assert self._anchor_done.wait(30)
            return False
        return self._real.wait(timeout)

    def is_set(self):
        return self._real.is_set()

    def set(self):
        self._real.set()


def test_a_header_that_lands_as_the_parsers_wait_times_out_still_gets_the_residual(cache_dir, monkeypatch):
    """The residual parser polls for the header; if the header, and the whole anchor after it, come in between
    its wait timing out and its next look, it must still read the residual (it once left, and the load never
    ended: a run waited on the full code for ever)."""
    _, path, _, _, (_, ref_full) = cache_dir
    real = ProgressiveLoad._residual_worker

    def late_worker(self):
        self._header_ready = _TimedOutJustThen(self._header_ready, self._anchor_done)
        return real(self)

    monkeypatch.setattr(ProgressiveLoad, "_residual_worker", late_worker)
    with open_progressive(path) as load:
        assert kv_equal(load.residual.result(30), ref_full)


@pytest.mark.timing
def test_close_stops_a_load_at_once(tmp_path):
    """close() while the anchor is still coming in and being dequantized: the residual worker, which waits for
    the anchor to be ready before it reads a residual page, leaves at once (not at a poll); queued pages are not
    decoded; every worker has ended when close returns. The anchor comes through a 50 MB/s link (about 0.4 s for
    its 21 MB), so the load is still going when close() comes, however busy the machine."""
    anchor, residual = synthetic_cache_bytes(layers=4, heads=8, tokens=4096, dim=128)
    path = write_pair(tmp_path, anchor, residual)
    for _ in range(3):
        load = ProgressiveLoad(str(path), dtype=torch.bfloat16, max_pending_pages=2, link=EmulatedLink(50e6))
        assert load._header_ready.wait(60)
        time.sleep(0.02)  # the residual transport is open, its worker waits for the anchor
        assert not load.residual.done()
        t0 = time.perf_counter()
        load.close()
        took = time.perf_counter() - t0
        assert took < 0.15, f"close() took {took:.3f} s"
        assert not any(t.is_alive() for t in load._threads)
        with pytest.raises(LynxError):
            load.residual.result(1)


# ------------------------------------------------------------------------------------------------ faults


def _hook(fail_segment: str, behaviour):
    calls = {"n": 0}

    def hook(segment, fetch):
        if segment != fail_segment:
            return fetch

        def wrapped(a, b):
            calls["n"] += 1
            return behaviour(calls["n"], fetch, a, b)

        return wrapped

    return hook


def test_stalled_residual_request_is_retried(cache_dir):
    *_, (_, ref_full) = cache_dir
    path = cache_dir[1]

    def stall_first(n, fetch, a, b):
        if n == 1:
            time.sleep(2.0)
        return fetch(a, b)

    with open_progressive(path, fetch_hook=_hook("residual", stall_first), retry=FAST_RETRY) as load:
        assert kv_equal(load.residual.result(30), ref_full)
        assert any("no answer" in r for r in load.timeline.extra["retries"])


def test_transient_resets_are_retried(cache_dir):
    *_, (_, ref_full) = cache_dir

    def reset_twice(n, fetch, a, b):
        if n <= 2:
            raise ConnectionResetError("connection reset by peer")
        return fetch(a, b)

    with open_progressive(cache_dir[1], fetch_hook=_hook("residual", reset_twice), retry=FAST_RETRY) as load:
        assert kv_equal(load.residual.result(30), ref_full)
        assert len(load.timeline.extra["retries"]) == 2


def _always_down(n, fetch, a, b):
    raise ConnectionResetError("connection reset by peer")


def test_residual_down_anchor_only_when_allowed(cache_dir):
    *_, (ref_anchor, _) = cache_dir
    with open_progressive(cache_dir[1], fetch_hook=_hook("residual", _always_down), retry=FAST_RETRY,
                          allow_anchor_only=True) as load:
        assert kv_equal(load.wait_anchor(30), ref_anchor)
        with pytest.raises(LynxError, match="failed after 3 attempts"):
            load.residual.result(30)
        events = list(load.events(timeout=30))
        assert load.anchor_only and "failed after" in load.timeline.residual_failed
    kinds = _kinds(events)
    assert "anchor_ready" in kinds and kinds[-1] == "residual_failed" and "residual_page" not in kinds


def test_residual_down_fails_the_load_by_default(cache_dir):
    with open_progressive(cache_dir[1], fetch_hook=_hook("residual", _always_down), retry=FAST_RETRY) as load:
        with pytest.raises(LynxError):
            load.residual.result(30)
        with pytest.raises(LynxError):
            load.wait_anchor(30)
        with pytest.raises(LynxError):
            list(load.events(timeout=30))
        assert load.timeline.residual_failed


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x40
    return bytes(b)


def _page_span(anchor: bytes, residual: bytes | None, segment: str, layer: int, page: int):
    from lynxkv.format import PageReader
    from lynxkv.format import constants as c
    from lynxkv.storage import BytesSource

    reader = PageReader(BytesSource(anchor))
    if segment == "anchor":
        return reader.index(c.SEGMENT_ANCHOR).span(layer, page)
    return reader.attach_residual(BytesSource(residual)).span(layer, page)


# A local file with nothing in between is read in place; a fetch hook (here one that changes nothing) sends its bytes
# through the block pump and the stream buffers instead. The checks must hold on both paths.
TRANSPORTS = {"in-place": {}, "pumped": {"fetch_hook": lambda segment, fetch: fetch}}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request):
    return TRANSPORTS[request.param]


def test_local_file_pages_are_read_in_place_and_dequantized_without_a_copy(cache_dir, monkeypatch):
    """With no link, hook or tee a local cache's page records reach the dequantization as views of the file's
    mapping, a batch of adjacent pages as one view (no copy at all); through the pump they are copies. The KV is
    load_kv's either way."""
    import mmap

    from lynxkv.stream import assembly

    _, path, _, _, (ref_anchor, ref_full) = cache_dir
    real, seen = assembly.dequantize_records, []

    def spy(anchor, anchor_at, residual, *args, **kwargs):
        seen.append((anchor, residual))
        return real(anchor, anchor_at, residual, *args, **kwargs)

    monkeypatch.setattr(assembly, "dequantize_records", spy)
    for name, options in sorted(TRANSPORTS.items()):
        seen.clear()
        with open_progressive(path, **options) as load:
            assert kv_equal(load.wait_anchor(30), ref_anchor)
            assert kv_equal(load.residual.result(30), ref_full)
        buffers = [b for pair in seen for b in pair if b is not None]
        assert len(buffers) >= 3 * 2, name  # every layer's anchor, then its full code
        in_place = [isinstance(b, memoryview) and isinstance(b.obj, mmap.mmap) for b in buffers]
        assert all(in_place) if name == "in-place" else not any(in_place), name


def _files_open_under(directory) -> list[str]:
    """Paths under ``directory`` this process holds open or mapped (Linux /proc)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    with open("/proc/self/maps") as maps:
        found += [line.split(maxsplit=5)[-1].strip() for line in maps if len(line.split(maxsplit=5)) == 6]
    return [f for f in found if f.startswith(str(directory))]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
@pytest.mark.parametrize("single", [False, True], ids=["two-files", "single-file"])
def test_a_finished_load_holds_no_file_open(tmp_path, transport, single):
    """Once a load has ended (its events are over) the files it read are closed and unmapped: not only at
    close(), which a caller keeping the KV may never call. Equally when its residual failed."""
    anchor, residual = cache_bytes(random_kv(layers=3, dim=64), single_file=single)
    path = write_pair(tmp_path, anchor, None if single else residual)
    load = open_progressive(path, **transport)
    assert len(load.residual.result(30)) == 3
    list(load.events(timeout=30))
    assert _files_open_under(tmp_path) == []
    load.close()
    if single:
        return
    os.remove(os.path.join(tmp_path, "x.lynxr"))
    failed = open_progressive(path, allow_anchor_only=True, **transport)
    with pytest.raises(LynxError):
        failed.residual.result(30)
    list(failed.events(timeout=30))
    assert _files_open_under(tmp_path) == []
    failed.close()


@pytest.mark.parametrize("link", [False, True], ids=["no-link", "link"])
@pytest.mark.parametrize("fault", [None, "residual"], ids=["whole", "residual-failed"])
def test_a_load_nobody_references_is_freed_at_once(tmp_path, transport, link, fault):
    """A closed load holds no reference cycle: once its last reference goes, it and its KV are freed at once, not
    at the next full garbage collection (a batch opens loads one after another; each would keep its KV till then).
    The cyclic collector is off for the test, so only reference counts can free them."""
    import gc
    import weakref

    anchor, residual = cache_bytes(random_kv(layers=3, dim=64))
    path = write_pair(tmp_path, anchor, residual)
    if fault:
        os.remove(os.path.join(tmp_path, "x.lynxr"))
    gc.collect()
    gc.disable()
    try:
        load = open_progressive(path, allow_anchor_only=True, link=link_at("50MB/s" if link else None), **transport)
        anchor_kv = load.wait_anchor(30)
        if fault:
            with pytest.raises(LynxError):
                load.residual.result(30)
        else:
            full = weakref.ref(load.residual.result(30)[0][0])
        list(load.events(timeout=30))
        load.close()
        refs = [weakref.ref(load), weakref.ref(anchor_kv[0][0])] + ([] if fault else [full])
        del load, anchor_kv
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
@pytest.mark.parametrize("corrupt", ["anchor", "residual", "exact"])
def test_a_load_a_corrupt_page_failed_holds_no_file_open_once_ended(tmp_path, corrupt):
    """As a finished load, one that a corrupt page failed closes and unmaps its files once its events are over,
    although the error it keeps (``residual``, ``exact``) was raised while those pages were being read."""
    from lynxkv.cache import save_cache

    save_cache(tmp_path / "c.lynx", random_kv(layers=3, dim=64), exact=True)
    name = {"anchor": "c.lynx", "residual": "c.lynxr", "exact": "c.lynxe"}[corrupt]
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(_flip(data, len(data) * 2 // 3))
    load = open_progressive(str(tmp_path / "c.lynx"), exact=True)
    with pytest.raises(ChecksumError):
        load.exact.result(30)
    try:
        list(load.events(timeout=30))
    except LynxError:
        assert corrupt != "exact"  # the load itself fails only without its anchor or full code
    assert _files_open_under(tmp_path) == []
    load.close()


@pytest.mark.parametrize("allow", [False, True], ids=["fail", "anchor-only"])
def test_corrupted_residual_page_is_never_delivered(tmp_path, cache_dir, allow, transport):
    _, _, anchor, residual, (ref_anchor, _) = cache_dir
    at, length = _page_span(anchor, residual, "residual", 1, 1)
    path = write_pair(tmp_path, anchor, _flip(residual, at + length // 2))
    seen = []
    with open_progressive(path, on_event=seen.append, allow_anchor_only=allow, **transport) as load:
        with pytest.raises(ChecksumError, match="residual layer 1 page 1") as info:
            load.residual.result(30)
        assert info.value.where == "residual layer 1 page 1"
        if allow:
            assert kv_equal(load.wait_anchor(30), ref_anchor) and load.anchor_only
        time.sleep(0.05)
    delivered = [(e.layer, e.page) for e in seen if e.kind == "residual_page"]
    assert (1, 1) not in delivered and all(p < (1, 1) for p in delivered)
    assert "residual_ready" not in _kinds(seen)


def test_corrupted_anchor_page_fails_before_anchor_ready(tmp_path, cache_dir, transport):
    _, _, anchor, residual, _ = cache_dir
    at, length = _page_span(anchor, residual, "anchor", 2, 0)
    path = write_pair(tmp_path, _flip(anchor, at + 3), residual)
    seen = []
    with open_progressive(path, on_event=seen.append, allow_anchor_only=True, **transport) as load:
        with pytest.raises(ChecksumError, match="anchor layer 2 page 0"):
            load.wait_anchor(30)
        with pytest.raises(ChecksumError):
            load.residual.result(30)
    assert (2, 0) not in [(e.layer, e.page) for e in seen if e.kind == "anchor_page"]
    assert "anchor_ready" not in _kinds(seen)


def test_truncated_residual_file(tmp_path, cache_dir, transport):
    _, _, anchor, residual, _ = cache_dir
    path = write_pair(tmp_path, anchor, residual[: len(residual) - 100])
    with open_progressive(path, allow_anchor_only=True, **transport) as load:
        with pytest.raises(FormatError, match="file_length.*truncated"):
            load.residual.result(30)
        load.wait_anchor(30)
        assert "truncated" in load.timeline.residual_failed


def test_missing_residual_and_bad_source(tmp_path, cache_dir, transport):
    _, _, anchor, _, _ = cache_dir
    path = write_pair(tmp_path, anchor, None)
    with open_progressive(path, **transport) as load:
        with pytest.raises(LynxError, match="no such file"):
            load.residual.result(30)
    with open_progressive(str(tmp_path / "nope.lynx"), **transport) as load:
        with pytest.raises(LynxError, match="no such file"):
            load.wait_anchor(30)


def test_random_residual_corruption_never_delivers_a_bad_page(tmp_path, cache_dir, transport):
    """Flip random bytes anywhere in the residual file: the load either fails with a LynxError before the
    damaged page, or (a flip in bytes nothing reads) completes with exactly the reference KV."""
    _, _, anchor, residual, (_, ref_full) = cache_dir
    g = torch.Generator().manual_seed(7)
    for i in range(6):
        at = int(torch.randint(0, len(residual), (1,), generator=g))
        path = write_pair(tmp_path, anchor, _flip(residual, at), name=f"r{i}")
        os.replace(os.path.join(tmp_path, f"r{i}.lynxr"), os.path.join(tmp_path, "x.lynxr"))
        with open_progressive(path, **transport) as load:
            try:
                full = load.residual.result(30)
            except LynxError:
                continue
            assert kv_equal(full, ref_full)


@pytest.mark.timing
def test_residual_eta_under_a_link(cache_dir):
    """Right after the anchor, the ETA is the residual's bytes over the rate seen so far (the link's own rate, less
    the load's set-up before its first byte: an ETA never below the truth by more than noise), and the residual then
    takes about that long (the runner sizes its speculation window with it)."""
    _, path, anchor, residual, (ref_anchor, ref_full) = cache_dir
    rate = 2e6  # bytes/s: the residual takes about 30 ms
    with open_progressive(path, link=link_at(rate)) as load:
        assert kv_equal(load.wait_anchor(30), ref_anchor)
        eta = load.residual_eta()
        t0 = time.perf_counter()
        assert kv_equal(load.residual.result(30), ref_full)
        took = time.perf_counter() - t0
        assert load.residual_eta() == 0.0
    assert eta is not None and len(residual) / rate - 0.01 <= eta <= 2 * len(residual) / rate + 0.02
    assert took == pytest.approx(eta, abs=0.05)


def test_several_ranged_reads_in_flight_and_residual_waits_its_turn(cache_dir):
    """Object stores answer several GETs at once: the anchor keeps ``inflight`` reads going; the residual keeps
    one until every anchor byte is in, then ``inflight`` too."""
    _, _, anchor, _, (_, ref_full) = cache_dir
    lock = threading.Lock()
    live = {"anchor": 0, "residual": 0}
    peak = {"anchor": 0, "residual": 0, "residual_during_anchor": 0}
    anchor_done = threading.Event()

    def hook(segment, fetch):
        def slow(a, b):
            with lock:
                live[segment] += 1
                peak[segment] = max(peak[segment], live[segment])
                if segment == "residual" and not anchor_done.is_set():
                    peak["residual_during_anchor"] = max(peak["residual_during_anchor"], live[segment])
            time.sleep(0.02)  # a store's first-byte latency
            try:
                return fetch(a, b)
            finally:
                with lock:
                    live[segment] -= 1
                    if segment == "anchor" and b == len(anchor):
                        anchor_done.set()  # the last anchor range is in (the residual opens up after this)

        return slow

    with open_progressive(cache_dir[1], fetch_hook=hook, block_size=4096, inflight=4) as load:
        assert kv_equal(load.residual.result(60), ref_full)
    assert peak["anchor"] >= 3 and peak["residual"] >= 3
    assert peak["residual_during_anchor"] <= 1


def test_loading_leaves_the_callers_torch_threads_alone(cache_dir):
    """torch.set_num_threads is process-wide: a load must not change it under a model decoding beside it."""
    _, path, *_ , (ref_anchor, ref_full) = cache_dir
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with open_progressive(path) as load:
            assert kv_equal(load.wait_anchor(30), ref_anchor)
            assert kv_equal(load.residual.result(30), ref_full)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_anchor_batches_decoded_on_workers_keep_the_order_and_the_values(cache_dir, monkeypatch, threads):
    monkeypatch.setenv("LYNXKV_CPU_THREADS", threads)  # 3: the consumer hands anchor batches to three workers
    _, path, _, _, (ref_anchor, ref_full) = cache_dir
    with open_progressive(path) as load:
        assert kv_equal(load.wait_anchor(30), ref_anchor)
        assert kv_equal(load.residual.result(30), ref_full)
        events = list(load.events(timeout=30))
    kinds = _kinds(events)
    assert kinds == ["anchor_page"] * 9 + ["anchor_ready"] + ["residual_page"] * 9 + ["residual_ready"]
    assert [(e.layer, e.page) for e in events if e.kind == "anchor_page"] == [(l, p) for l in range(3) for p in range(3)]


def test_a_decode_error_on_a_worker_fails_the_anchor(cache_dir, monkeypatch):
    import lynxkv.stream.assembly as assembly

    monkeypatch.setenv("LYNXKV_CPU_THREADS", "3")
    real = assembly.dequantize_records

    def bad_layer_1(*args, **kwargs):
        if args[-2](0).startswith("layer 1"):  # where(i) names the page
            raise FormatError("`page` anchor layer 1 page 0: metadata out of range")
        return real(*args, **kwargs)

    monkeypatch.setattr(assembly, "dequantize_records", bad_layer_1)
    seen = []
    with open_progressive(cache_dir[1], on_event=seen.append) as load:
        with pytest.raises(FormatError, match="layer 1 page 0"):
            load.wait_anchor(30)
    assert not [e for e in seen if e.kind == "anchor_page" and e.layer >= 1] and "anchor_ready" not in _kinds(seen)


def test_the_residual_is_dequantized_once_it_is_all_in_at_the_lowest_priority(cache_dir, monkeypatch):
    import sys

    calls, priorities = [], []
    from lynxkv.stream.assembly import KVAssembly

    real_residual, real_pages = KVAssembly.residual, KVAssembly.pages

    def residual(self, items, anchors, *rest):
        calls.append([(it[1], it[2]) for it in items])
        return real_residual(self, items, anchors, *rest)

    def pages(self, layer, pages, anchors, residuals, threads=None):
        if residuals is not None and sys.platform.startswith("linux"):
            priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_pages(self, layer, pages, anchors, residuals, threads)

    monkeypatch.setenv("LYNXKV_CPU_THREADS", "2")
    monkeypatch.setattr(KVAssembly, "residual", residual)
    monkeypatch.setattr(KVAssembly, "pages", pages)
    _, path, _, _, (_, ref_full) = cache_dir
    with open_progressive(path) as load:
        assert kv_equal(load.residual.result(30), ref_full)
    assert calls == [[(layer, p) for layer in range(3) for p in range(3)]]  # one pass, when every page was in
    if sys.platform.startswith("linux"):
        assert priorities and set(priorities) == {19}


def test_layer_in_waits_without_spinning_until_the_outputs_exist(cache_dir, monkeypatch):
    """Between the header's arrival and the consumer making the KV outputs, ``layer_in`` sleeps on a condition (it
    once polled an event already set, in a busy loop); once the outputs exist it returns True for a layer that is
    all in."""
    from lynxkv.stream import consumer
    from lynxkv.stream.assembly import KVAssembly

    go = threading.Event()

    class HeldAssembly(KVAssembly):
        def __init__(self, *args, **kwargs):
            go.wait(30)  # the consumer has the header but holds off making the outputs
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(consumer, "KVAssembly", HeldAssembly)
    _, path, _, _, (_, ref_full) = cache_dir
    with open_progressive(path) as load:
        assert load._header_ready.wait(30)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        assert load.layer_in(0, timeout=0.5) is False
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        go.set()
        assert load.layer_in(2, timeout=30) is True
        assert kv_equal(load.residual.result(30), ref_full)
    assert wall >= 0.5
    assert cpu < 0.1 * wall, f"layer_in used {cpu:.3f} s of CPU in {wall:.3f} s of waiting"


@pytest.mark.parametrize("hold", [True, False])
def test_landed_layers_are_dequantized_by_the_caller_who_asks_and_residual_in_says_when_all_bytes_are(
        tmp_path, hold):
    """``dequantize_landed`` (what the runner calls between draft steps) dequantizes, in the calling thread, the
    layers whose residual is in and that no worker has begun, and never waits; ``residual_in`` turns True once
    every residual byte is in, whether or not the full code is built (``hold_early(True)``: the load's worker leaves
    the landed layers to the caller). The full code equals load_kv's."""
    anchor, residual = cache_bytes(random_kv(layers=6, heads=4, tokens=1024, dim=64))
    path = write_pair(tmp_path, anchor, residual)
    taken, bytes_in_before_done = 0, False
    with open_progressive(str(path), link=link_at("8Mbps"), block_size=64 << 10, inflight=1) as load:
        load.wait_anchor(60)
        load.hold_early(hold)
        assert not load.residual_in()
        while not load.residual.done():
            taken += load.dequantize_landed()
            bytes_in_before_done |= load.residual_in() and not load.residual.done()
            time.sleep(0.005)
        full = load.residual.result(60)
        assert load.residual_in() and load.dequantize_landed() == 0
    if hold:  # no worker takes layers early: every layer but those landing with the last bytes is ours
        assert 3 <= taken <= 6, taken
    else:  # the lowest-priority worker and the caller share them, each layer done once
        assert 0 <= taken <= 6, taken
    with open_cache(str(path)) as cache:
        assert kv_equal(full, cache.load_kv(dtype=torch.float32))


def test_a_layer_that_fails_when_taken_early_is_left_for_the_load_to_report(tmp_path, monkeypatch):
    """A landed layer whose dequantization fails in the asking thread is put back untouched: the caller gets no
    exception, and the load's own workers build that layer as without the early take (an error there is the
    load's to report, through its residual)."""
    from lynxkv.stream.assembly import KVAssembly

    anchor, residual = cache_bytes(random_kv(layers=3, heads=2, tokens=600, dim=16))
    path = write_pair(tmp_path, anchor, residual)
    real = KVAssembly.pages
    main = threading.get_ident()

    def pages(self, *args, **kwargs):
        if threading.get_ident() == main:
            raise ChecksumError("layer record damaged (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVAssembly, "pages", pages)
    with open_progressive(str(path), link=link_at("2Mbps"), block_size=16 << 10, inflight=1) as load:
        load.wait_anchor(60)
        load.hold_early(True)  # the landed layers are left to this thread, whose every take fails
        while not load.residual.done():
            assert load.dequantize_landed() == 0  # every try fails, quietly
            time.sleep(0.005)
        full = load.residual.result(60)  # the load's own workers decode the layers put back
    with open_cache(str(path)) as cache:
        assert kv_equal(full, cache.load_kv(dtype=torch.float32))


def test_a_layer_whose_early_job_found_it_taken_is_dequantized_once_it_is_given_up(monkeypatch):
    """An early job that started after a caller began taking the layers itself does nothing; when the caller
    gives the layers up, that layer gets a new early job rather than waiting for the end of the residual."""
    from concurrent.futures import wait
    from lynxkv.stream.assembly import KVAssembly

    kv = object.__new__(KVAssembly)  # only the early-worker state (the dequantization itself is stood in for)
    kv.__dict__.update(_early=None, _early_jobs={}, _early_lock=threading.Lock(), _closed_early=False,
                       _done=[False, False], _jobs={0: "job 0", 1: "job 1"}, urgent=True)
    done = []

    def full_layer(layer, threads=None):
        done.append(layer)
        kv._done[layer] = True

    monkeypatch.setattr(kv, "full_layer", full_layer, raising=False)
    kv._start_early(0)  # queued before the caller came, run after: it finds the layers taken
    wait(list(kv._early_jobs.values()))
    assert done == []
    kv.relax()
    wait(list(kv._early_jobs.values()))
    assert sorted(done) == [0, 1]
    kv._end_early()
