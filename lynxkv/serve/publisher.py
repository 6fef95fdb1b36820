"""Prefill and publish: run a prompt through a model and serve its cache over HTTP while it is being encoded.

The pipeline (:class:`PrefillPublisher`). The prefill's forward pass runs on the calling thread; a forward hook on
each decoder layer hands that layer's keys and values over as soon as the layer has run (a prefill writes each
layer's cache once, before the next layer starts). A writer thread quantizes each layer as it arrives and writes
its pages (:func:`lynxkv.format.writer.write_files`, no zstd, two files) into two
:class:`~lynxkv.serve.publish.GrowingFile` s, the anchor file and the residual file, which a
:class:`~lynxkv.serve.publish.PublishServer` serves: a page is readable once written, the headers and page indexes
(written last) once whole, the anchor header's fixed part from the start (:func:`lynxkv.format.writer.planned_framing`
computes the files' sizes and that part before any page exists). So the anchor crosses the network while later
layers are still being computed, and a reader checks every page's CRC as with any other cache.

The tier copy. With ``out`` the same bytes also go to ``out`` and its residual file (``x.lynxr`` beside it) through
:class:`~lynxkv.storage.AtomicWriter` s: the residual is published first, then the anchor, each complete or not at
all, once every page is written; a failure leaves neither.

Failure. Any error of the forward pass or the writer fails both files: every response waiting for their bytes is
cut off (the readers see a transfer error, never a page that is not final) and nothing reaches the tier.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from lynxkv.cache.encoded import EncodedCache
from lynxkv.cache.kv import DTYPE_NAMES
from lynxkv.cache.replace import fresh_residual_name
from lynxkv.cache.save import residual_file_of
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.writer import planned_framing, write_files
from lynxkv.hf.models import kv_shape
from lynxkv.hf.prefill import forward
from lynxkv.quant import quantize
from lynxkv.quant.scheme import Scheme
from lynxkv.serve.publish import GrowingFile
from lynxkv.storage import AtomicWriter

LAYER_TIMEOUT = 600.0  # seconds the writer waits for the forward pass to hand over the next layer


class ForwardLayers:
    """The layers of a prefill in progress, quantized as the forward pass hands each over (what the writer reads as
    ``enc.layers``): iterating waits for layer ``i`` and checks its shape and dtype against the plan."""

    def __init__(self, count: int, scheme: Scheme, shape: tuple[int, int, int], dtype: torch.dtype,
                 timeout: float = LAYER_TIMEOUT, on_last=None):
        self._count, self._scheme, self._shape, self._dtype = count, scheme, shape, dtype
        self._on_last = on_last  # called when the last layer is handed over
        self._queue: queue.Queue = queue.Queue()
        self._timeout = timeout
        self.handed = 0  # layers handed over so far (the forward pass's progress)

    def __len__(self) -> int:
        return self._count

    def hand(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The next layer's ``[1, H, T, D]`` (or ``[H, T, D]``) keys and values, final."""
        self._queue.put((keys[0] if keys.dim() == 4 else keys, values[0] if values.dim() == 4 else values))
        self.handed += 1
        if self.handed == self._count and self._on_last is not None:
            self._on_last()

    def abort(self, exc: BaseException) -> None:
        self._queue.put(exc)

    def __iter__(self):
        for i in range(self._count):
            try:
                item = self._queue.get(timeout=self._timeout)
            except queue.Empty:
                raise LynxError(f"layer {i}: the forward pass did not hand it over within {self._timeout:g} s"
                                ) from None
            if isinstance(item, BaseException):
                raise item
            for t, what in zip(item, ("keys", "values")):
                if tuple(t.shape) != self._shape or t.dtype != self._dtype:
                    raise LynxError(f"layer {i} {what}: {tuple(t.shape)} {t.dtype}, the plan says {self._shape} "
                                    f"{self._dtype}")
            yield tuple(quantize(t.detach(), self._scheme, kind, packed=True).to("cpu")
                        for t, kind in zip(item, ("key", "value")))


class _Tee:
    """A :class:`~lynxkv.format.writer.PageSink` that writes to several sinks (the published file, the tier's)."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def write(self, data) -> None:
        for s in self.sinks:
            s.write(data)

    def reserve(self, n: int) -> int:
        at = {s.reserve(n) for s in self.sinks}
        if len(at) != 1:
            raise LynxError("the sinks of one file disagree on its length")
        return at.pop()

    def fill(self, offset: int, data) -> None:
        for s in self.sinks:
            s.fill(offset, data)


def check_name(name: str) -> None:
    """The anchor's URL name: a plain file name (the residual is served beside it)."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or any(ord(ch) < 32 or ord(ch) == 127
                                                                             for ch in name):
        raise InputError(f"--name {name!r}: expected a plain file name")


def decoder_layers(model) -> list | None:
    """The model's decoder layers in order (``model.model.layers`` in Hugging Face causal LMs), or None."""
    want = kv_shape(model.config)[0]
    for owner in (getattr(model, "model", None), model, getattr(getattr(model, "model", None), "language_model", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == want:
            return list(layers)
    return None


@dataclass
class PublishReport:
    """What a published prefill took (seconds from the start of :meth:`PrefillPublisher.run`)."""

    tokens: int
    layers: int
    anchor_bytes: int
    residual_bytes: int
    kv_s: float = 0.0  # the last layer's KV handed over (the prefill's cache complete)
    forward_s: float = 0.0  # the forward pass, hooks included
    anchor_s: float = 0.0  # every anchor byte final (header included)
    done_s: float = 0.0  # both files final (and the tier copy published)
    started_at: float = 0.0  # time.time() at the start
    saved: list = field(default_factory=list)  # the tier's files, residual first


class PrefillPublisher:
    """One prompt's prefill published as ``name`` (see the module docstring). ``files`` are the two growing files
    to serve; :meth:`run` computes and writes them."""

    def __init__(self, model, input_ids: torch.Tensor, scheme: Scheme, *, name: str, out: str | None = None,
                 fingerprint: str | None = None, properties: dict | None = None, cache_id: bytes | None = None):
        self.model = model
        self.ids = input_ids.reshape(1, -1)
        if self.ids.shape[1] == 0:
            raise InputError("the prompt is empty")
        check_name(name)
        layers, heads, dim = kv_shape(model.config)
        dtype = next(model.parameters()).dtype
        if dtype not in DTYPE_NAMES:
            raise InputError(f"the model runs in {dtype}: a cache stores fp32, fp16 or bf16 KV")
        tokens = self.ids.shape[1]
        self.cache_id = secrets.token_bytes(16) if cache_id is None else cache_id
        self.layers = ForwardLayers(layers, scheme, (heads, tokens, dim), dtype, on_last=self._kv_complete)
        self.enc = EncodedCache(scheme, self.layers, heads, dim, tokens, DTYPE_NAMES[dtype],  # type: ignore[arg-type]
                                self.ids[0].tolist(), fingerprint, properties=properties)
        stem = name[:-len(".lynx")] if name.endswith(".lynx") else name
        self.out = os.fspath(out) if out is not None else None
        self.residual_location = stem + c.RESIDUAL_SUFFIX
        self._replaced: str | None = None  # the residual of the cache --out replaces, removed once it is replaced
        if self.out is not None and os.path.exists(self._beside_out(self.residual_location)):
            # as save_cache does: the new residual under a fresh name, so that the anchor still there keeps its own
            # until the new one replaces it (a reader sees the old cache or the new one, never a mix)
            self._replaced = residual_file_of(self.out)
            self.residual_location = fresh_residual_name(self.residual_location, self.cache_id)
        framing = planned_framing(self.enc, cache_id=self.cache_id, residual_location=self.residual_location)
        a_seg, r_seg = framing.header.segments[:2]
        self.anchor = GrowingFile("anchor", name, a_seg.offset + a_seg.length)
        self.residual = GrowingFile("residual", self.residual_location, r_seg.length)
        # The fixed part of the header depends on no page: final now, so a reader learns the layout at once.
        self.anchor.provisional(0, framing.anchor_lead, c.ANCHOR_FIXED_SIZE)
        self.report = PublishReport(tokens, layers, self.anchor.size, self.residual.size)
        self.error: BaseException | None = None

    def _kv_complete(self) -> None:
        self.report.kv_s = time.perf_counter() - self._t0

    @property
    def files(self) -> list[GrowingFile]:
        return [self.anchor, self.residual]

    def fail(self, why: str) -> None:
        for f in self.files:
            f.fail(why)

    def run(self) -> PublishReport:
        """Prefill, encode and publish; return the timings (raise the pipeline's error, after failing the files)."""
        t0, r = time.perf_counter(), self.report
        self._t0 = t0
        r.started_at = time.time()
        writer = threading.Thread(target=self._write, args=(t0,), name="lynxkv-publish", daemon=True)
        writer.start()
        try:
            self._forward()
        except BaseException as exc:
            self.layers.abort(exc if isinstance(exc, LynxError) else LynxError(f"prefill: {type(exc).__name__}: {exc}"))
            writer.join()
            raise
        r.forward_s = time.perf_counter() - t0
        writer.join()
        if self.error is not None:
            raise self.error
        r.done_s = time.perf_counter() - t0
        return r

    @torch.no_grad()
    def _forward(self) -> None:
        from transformers import DynamicCache

        cache = DynamicCache()  # no config: every layer keeps every prompt token (lynxkv.hf.prefill)
        blocks = decoder_layers(self.model)
        hooks = []
        if blocks is not None:
            for i, block in enumerate(blocks):
                hooks.append(block.register_forward_hook(
                    lambda module, args, output, i=i: self.layers.hand(cache.layers[i].keys, cache.layers[i].values)))
        try:
            # the cache is all a prefill publishes: the logits of the last position only (not [T, vocab])
            forward(self.model, self.ids.to(self.model.device), cache, logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        if blocks is None:  # no layer to hook: hand them all over at the end
            for layer in cache.layers:
                self.layers.hand(layer.keys, layer.values)

    def _write(self, t0: float) -> None:
        tier: list[AtomicWriter] = []
        try:
            self._tier_writers(tier)
            anchor = _Tee(self.anchor, *tier[1:])
            residual = _Tee(self.residual, *tier[:1])
            write_files(self.enc, anchor, residual, cache_id=self.cache_id, residual_location=self.residual_location)
            for f in self.files:
                if not f.complete:
                    raise LynxError(f"{f.name}: the cache came out shorter than planned")
            self.report.anchor_s = time.perf_counter() - t0
            for w in tier:  # the residual first: an anchor never points at a missing residual
                w.commit()
                self.report.saved.append(w.url)
            if self._replaced is not None and os.path.basename(self._replaced) != self.residual_location:
                with contextlib.suppress(OSError):  # the replaced cache's residual, referenced no more
                    os.remove(self._replaced)
        except BaseException as exc:  # noqa: BLE001 - every failure fails the files, then the caller raises it
            for w in tier:
                w.abort()
            self.error = exc if isinstance(exc, LynxError) else LynxError(f"publish: {type(exc).__name__}: {exc}")
            self.fail(str(self.error))

    def _beside_out(self, name: str) -> str:
        return posixpath.join(os.path.dirname(self.out), name) if os.path.dirname(self.out) else name

    def _tier_writers(self, tier: list) -> None:
        """Add the tier copy's residual writer, then its anchor writer, to ``tier`` (nothing without ``out``)."""
        if self.out is not None:
            tier.append(AtomicWriter(self._beside_out(self.residual_location)))
            tier.append(AtomicWriter(self.out))
