"""KV tensors -> an :class:`EncodedCache` in memory (what a ``.lynx`` file stores): shapes and dtypes checked,
each layer quantized when the writer reaches it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import itertools
from collections.abc import Iterable, Sequence

import torch

from lynxkv.cache.kv import DTYPE_NAMES, KVPairs, TORCH_DTYPES, cache_to_kv
from lynxkv.errors import InputError
from lynxkv.quant import EncodedTensor, dequantize, quantize
from lynxkv.quant.dispatch import concurrent_tensors
from lynxkv.quant.scheme import DEFAULT, Scheme


@dataclass
class EncodedCache:
    """A quantized KV cache in memory: what a ``.lynx`` file stores."""

    scheme: Scheme
    layers: list[tuple[EncodedTensor, EncodedTensor]]  # per layer (keys, values)
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str = "fp32"  # the dtype the cache had before encoding: fp32 | fp16 | bf16
    prompt_token_ids: list[int] | None = None
    model_fingerprint: str | None = None
    names: tuple[str, ...] | None = None  # K0, V0, K1, V1, ... as they were in the input file
    batch_dim: bool = False  # the input tensors were [1, H, T, D]
    properties: dict[str, str] | None = None  # text key/value pairs: lynxkv.model, an input file's metadata ...
    originals: list | None = None  # the input (keys, values) [H, T, D] per layer, kept for an exact segment

    @property
    def pages_per_layer(self) -> int:
        return -(-self.tokens // self.scheme.page)

    def dequantize(self, *, anchor_only: bool = False, dtype: torch.dtype | None = None) -> KVPairs:
        out_dtype = dtype or TORCH_DTYPES[self.dtype]
        return [(dequantize(k, self.scheme, anchor_only=anchor_only, dtype=out_dtype),
                 dequantize(v, self.scheme, anchor_only=anchor_only, dtype=out_dtype)) for k, v in self.layers]


def _as_hdt(t: torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.dim() == 4:
        if t.shape[0] != 1:
            raise InputError(f"{what}: a 4-d tensor must be [1, kv_heads, tokens, head_dim], got {tuple(t.shape)}")
        return t[0], True
    if t.dim() != 3:
        raise InputError(f"{what}: expected [kv_heads, tokens, head_dim], got shape {tuple(t.shape)}")
    return t, False


def encode_kv(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], scheme: Scheme = DEFAULT, *,
              prompt_token_ids: Sequence[int] | None = None, model_fingerprint: str | None = None,
              names: Sequence[str] | None = None) -> EncodedCache:
    """Quantize every layer's keys and values (``[H, T, D]`` or ``[1, H, T, D]``, fp32/fp16/bf16), given as
    per-layer pairs or as a ``transformers`` cache (:func:`lynxkv.cache.kv.cache_to_kv`), on their device
    (:func:`lynxkv.quant.quantize`: on a GPU the Triton kernels where they support the scheme, else the torch
    reference there; on the CPU the compiled kernels); only the codes and metadata come back to the CPU for the
    writer."""
    enc = lazy_encoding(kv, scheme, prompt_token_ids, model_fingerprint, names)
    enc.layers = list(enc.layers)
    return enc


class _QuantizedLayers(Sequence):
    """The layers of a cache quantized when each is read (not kept): what :func:`save_cache` hands the writer, so
    that a few layers' codes are in memory at a time. ``packed``: the codes two per byte where the scheme allows
    (:attr:`lynxkv.quant.EncodedTensor.packed`, the bytes the page records store). Iterating quantizes the next
    layers on the CPU workers, one layer each (:func:`lynxkv.quant.dispatch.concurrent_tensors`), while the caller
    writes the one before them."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], scheme: Scheme, packed: bool):
        self._pairs, self._scheme, self._packed = pairs, scheme, packed

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return _quantize_layer(self._pairs[i], self._scheme, self._packed)

    def __iter__(self):
        cpu = all(t.device.type == "cpu" for pair in self._pairs for t in pair)
        yield from _quantized(iter(self._pairs), self._scheme, self._packed, cpu, len(self))


def _quantize_layer(pair, scheme: Scheme, packed: bool, threads: int | None = None):
    return tuple(quantize(t.detach(), scheme, kind, packed=packed, threads=threads).to("cpu")
                 for t, kind in zip(pair, ("key", "value")))


def _quantized(pairs, scheme: Scheme, packed: bool, cpu: bool, most: int):
    """Each of ``pairs`` quantized, in order: on the CPU, the next layers on the workers (one each, at most
    :func:`concurrent_tensors` or ``most`` pairs taken from ``pairs`` and not yet handed out) while the caller uses
    the last."""
    workers = min(concurrent_tensors(), most) if cpu else 1
    yield from _on_workers(pairs, lambda pair, threads: _quantize_layer(pair, scheme, packed, threads), workers)


def _on_workers(items, work, workers: int):
    """``work(item, threads)`` of each of ``items``, in order: with several ``workers``, the next items on them
    (one each, ``threads=1``, at most ``workers`` items taken and not yet handed out) while the caller uses the
    last; else one at a time, each on every thread (``threads=None``)."""
    if workers <= 1:
        yield from (work(item, None) for item in items)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(workers, thread_name_prefix="lynxkv-encode")
    try:
        ahead: deque = deque()
        for item in items:
            ahead.append(pool.submit(work, item, 1))
            del item  # the worker holds it while it is needed
            if len(ahead) == workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _StreamedLayers:
    """The layers of a cache taken from an iterator one at a time (checked against the first one's shape and
    dtype, and against the declared count) and quantized as the writer reaches them
    (:func:`streamed_encoding`). Iterable once. With ``keep``, each layer's originals stay until the writer takes
    them for the exact segment (:attr:`originals`), so a layer is held from when it is read until it is written."""

    def __init__(self, first, rest, count: int, scheme: Scheme, packed: bool, keep: bool, window: int):
        self._first, self._rest, self._count, self._window = first, rest, count, window
        self._scheme, self._packed, self._keep = scheme, packed, keep
        self._ref = _checked_pair(first, 0)[2]  # layer 0's keys: (shape [H, T, D], batched, dtype, device)
        self._held: dict[int, tuple] = {}
        self.originals = _HeldOriginals(self) if keep else None

    def __len__(self) -> int:
        return self._count

    @property
    def shape(self) -> tuple:
        """(``[H, T, D]``, batched, dtype, device) of every layer: layer 0's keys'."""
        return self._ref

    def _pairs(self):
        first, self._first = self._first, None
        if first is None:
            raise InputError("layers: a stream of layers can be read once")
        n, pairs = 0, itertools.chain((first,), self._rest)
        del first
        for pair in pairs:
            if n == self._count:
                raise InputError(f"layers: more than the {self._count} layers declared")
            checked = _checked_pair(pair, n, self._ref)
            if self._keep:
                self._held[n] = checked[:2]
            yield checked[:2]
            n += 1
        if n != self._count:
            raise InputError(f"layers: {n} layers given, {self._count} declared")

    def __iter__(self):
        cpu = self._first is None or all(t.device.type == "cpu" for t in self._first)
        yield from _quantized(self._pairs(), self._scheme, self._packed, cpu, min(self._count, self._window))


class _HeldOriginals:
    """The originals of a streamed cache's layers, each handed to the writer once (then let go)."""

    def __init__(self, layers: _StreamedLayers):
        self._layers = layers

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: int):
        return self._layers._held.pop(i)


def _checked_pair(pair, i: int, ref: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Layer ``i``'s ``(keys, values)`` as ``[H, T, D]``, checked: a pair of fp32/fp16/bf16 tensors holding values
    (not meta) of the shape, batch dimension, dtype and device ``ref`` (layer 0's keys'; None: these keys set it);
    and ``ref``."""
    if len(pair) != 2:
        raise InputError(f"layer {i}: expected a (keys, values) pair")
    out = []
    for j, t in enumerate(pair):
        what = f"layer {i} {'keys' if j == 0 else 'values'}"
        t3, b = _as_hdt(t, what)
        if t3.dtype not in DTYPE_NAMES:
            raise InputError(f"{what}: dtype {t3.dtype} is not one of fp32, fp16, bf16")
        if t3.device.type == "meta":
            raise InputError(f"{what}: a meta tensor holds no values to encode")
        if ref is None:
            ref = (tuple(t3.shape), b, t3.dtype, t3.device)
        shape, batch, dtype, device = ref
        if tuple(t3.shape) != shape or b != batch or t3.dtype != dtype:
            raise InputError(f"{what}: shape {tuple(t.shape)} {t.dtype} differs from layer 0 keys "
                             f"({'[1, ' if batch else '['}{', '.join(map(str, shape))}] {dtype})")
        if t3.device != device:
            raise InputError(f"{what}: on {t3.device}, layer 0 keys on {device}: one device per cache")
        out.append(t3)
    return out[0], out[1], ref


def lazy_encoding(kv, scheme: Scheme, prompt_token_ids, model_fingerprint, names, *,
                  packed: bool = False) -> EncodedCache:
    """An :class:`EncodedCache` of ``kv`` (checked: shapes, dtypes) whose layers are quantized when read."""
    kv = cache_to_kv(kv)  # a transformers DynamicCache, or the pairs as given
    if not len(kv):
        raise InputError("kv: expected at least one layer")
    pairs, ref = [], None
    for i, pair in enumerate(kv):
        k, v, ref = _checked_pair(pair, i, ref)
        pairs.append((k, v))
    (h, t, d), batch, dtype, _ = ref
    return EncodedCache(scheme, _QuantizedLayers(pairs, scheme, packed), h, d, t, DTYPE_NAMES[dtype],
                        list(prompt_token_ids) if prompt_token_ids is not None else None,
                        model_fingerprint or None, tuple(names) if names else None, bool(batch), originals=pairs)


def encode_layer_bytes(kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """About the memory one layer takes while it is encoded: its keys and values, the quantizer's fp32 work on
    them and their codes (what a window of :func:`streamed_encoding` holds per layer)."""
    return 2 * kv_heads * tokens * head_dim * (torch.empty((), dtype=dtype).element_size() + 4 + 1)


def encode_token_bytes(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """:func:`encode_layer_bytes` of one token: what a piece of a layer takes per token while it is encoded."""
    return encode_layer_bytes(kv_heads, 1, head_dim, dtype)


def piece_plan(memory: int, kv_heads: int, tokens: int, head_dim: int, dtype: torch.dtype, page: int,
               workers: int | None = None) -> tuple[int, int]:
    """``(tokens per piece, workers)`` of an encoding in pieces (:func:`pieced_encoding`) that holds about
    ``memory`` bytes: the pieces in flight (one per worker and the one being written, or one with a single
    worker) of :func:`encode_token_bytes` per token, each as many whole pages as fit (never more than a layer).
    ``workers``: at most this many (default :func:`concurrent_tensors`), fewer where pieces of a page do not fit
    that many. A bound below one page is refused."""
    per_page = encode_token_bytes(kv_heads, head_dim, dtype) * max(1, min(page, tokens))
    if per_page > memory:
        raise InputError(f"memory: one page of this cache ({min(page, tokens)} tokens of {kv_heads} heads x "
                         f"{head_dim}, keys and values) takes about {per_page:,} bytes to encode, more than the "
                         f"{memory:,} allowed")
    fit = memory // per_page  # pieces of one page that fit
    workers = max(1, min(workers or concurrent_tensors(), fit - 1))
    flight = workers + 1 if workers > 1 else 1
    pages = max(1, memory // flight // per_page)
    return max(1, min(pages * page, tokens)), workers


class _Pieced:
    """The layers of a cache encoded in pieces of whole pages (:func:`pieced_encoding`): each layer a
    :class:`lynxkv.format.writer.Pieces` whose pieces are quantized on the workers as the writer reaches them. A
    flat stream of pieces feeds the layers in order, so the workers run ahead across a layer's end. Iterable
    once; each layer's pieces are to be taken before the next layer."""

    def __init__(self, pieces, count: int, shape: tuple, dtype: torch.dtype, scheme: Scheme, keep: bool,
                 piece_tokens: int, workers: int):
        self._pieces, self._count, self._shape, self._dtype = pieces, count, shape, dtype
        self._scheme, self._keep, self._step, self._workers = scheme, keep, piece_tokens, workers

    def __len__(self) -> int:
        return self._count

    def _checked(self):
        """The pieces as given, checked against the plan: layer by layer, ``piece_tokens`` each from token 0."""
        h, t, d = self._shape
        want = [(i, start) for i in range(self._count) for start in range(0, max(t, 1), self._step)]
        n = 0
        for piece in self._pieces:
            if n == len(want):
                raise InputError(f"pieces: more than the {len(want)} pieces of {self._count} layers")
            i, start, k, v = piece
            del piece
            size = min(self._step, t - start)
            for what, x in (("keys", k), ("values", v)):
                if (i, start) != want[n] or tuple(x.shape) != (h, size, d) or x.dtype != self._dtype:
                    raise InputError(f"layer {i} {what}: a piece of {tuple(x.shape)} {x.dtype} from token {start}, "
                                     f"expected layer {want[n][0]}'s [{h}, {size}, {d}] {self._dtype} from token "
                                     f"{want[n][1]}")
            yield i, start, k, v
            n += 1
        if n != len(want):
            raise InputError(f"pieces: {n} given, {len(want)} expected ({self._count} layers)")

    def _encode(self, item, threads):
        from lynxkv.format.writer import Piece

        i, start, k, v = item
        sinks = max(0, min(self._scheme.sink_tokens, self._shape[1], start + k.shape[1]) - start)
        keys, values = (dataclasses.replace(e, sinks=sinks)
                        for e in _quantize_layer((k, v), self._scheme, True, threads))
        return i, Piece(start, keys, values, (k, v) if self._keep else None)

    def __iter__(self):
        from lynxkv.format.writer import Pieces

        flat = _on_workers(self._checked(), self._encode, self._workers)
        per_layer = len(range(0, max(self._shape[1], 1), self._step))

        def layer(i):
            for _ in range(per_layer):
                j, piece = next(flat)
                assert j == i
                yield piece
                del piece  # before the next piece is taken

        try:
            for i in range(self._count):
                yield Pieces(layer(i))
            next(flat, None)  # the stream's own checks: nothing more
        finally:
            flat.close()


class _CarriedByPieces:
    """The originals of a cache encoded in pieces: each piece carries its own (:attr:`Piece.originals`)."""

    def __init__(self, count: int):
        self._count = count

    def __len__(self) -> int:
        return self._count


def pieced_encoding(pieces: Iterable, count: int, shape: tuple[int, int, int], dtype: torch.dtype, scheme: Scheme, *,
                    piece_tokens: int, workers: int, batched: bool = False, prompt_token_ids=None,
                    model_fingerprint=None, names=None, keep_originals: bool = False) -> EncodedCache:
    """An :class:`EncodedCache` of ``count`` layers of ``shape`` ``[H, T, D]`` and ``dtype`` given as ``pieces``:
    ``(layer, start, keys, values)``, each layer's tokens in pieces of ``piece_tokens`` (the last one the rest;
    :meth:`lynxkv.cache.dumps.KVDump.iter_pieces`), ``piece_tokens`` a multiple of the scheme's page or at least
    ``T``. Each piece is quantized as the writer reaches it (on up to ``workers`` CPU workers, one piece each) and
    its pages written before the next is taken: memory holds a few pieces (:func:`piece_plan`), not a layer. The
    codes are those of the whole layers. ``keep_originals``: each piece keeps its input for the exact segment."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InputError(f"layers: expected a count of at least one layer, got {count!r}")
    if dtype not in DTYPE_NAMES:
        raise InputError(f"dtype {dtype} is not one of fp32, fp16, bf16")
    h, t, d = shape
    if piece_tokens < 1 or (piece_tokens % scheme.page and piece_tokens < t):
        raise InputError(f"piece_tokens: expected whole pages of {scheme.page} tokens (or the {t} of a layer), "
                         f"got {piece_tokens}")
    layers = _Pieced(pieces, count, (h, t, d), dtype, scheme, keep_originals, min(piece_tokens, max(t, 1)), workers)
    return EncodedCache(scheme, layers, h, d, t, DTYPE_NAMES[dtype],
                        list(prompt_token_ids) if prompt_token_ids is not None else None,
                        model_fingerprint or None, tuple(names) if names else None, bool(batched),
                        originals=_CarriedByPieces(count) if keep_originals else None)


def streamed_encoding(layers: Iterable, count: int, scheme: Scheme, prompt_token_ids, model_fingerprint, names, *,
                      keep_originals: bool, window: int = 2) -> EncodedCache:
    """An :class:`EncodedCache` of ``count`` layers taken from the iterable ``layers`` of ``(keys, values)`` as
    the writer reaches them (the first one read now, for the shape): one pass, about ``window`` layers in memory
    at a time (quantized by at most that many workers). ``keep_originals``: each layer's originals are held until
    the writer's exact segment takes them."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InputError(f"layers: expected a count of at least one layer, got {count!r}")
    it = iter(layers)
    first = next(it, None)
    if first is None:
        raise InputError("layers: expected at least one layer, got none")
    streamed = _StreamedLayers(first, it, count, scheme, True, keep_originals, window)
    (h, t, d), batch, dtype, _ = streamed.shape
    return EncodedCache(scheme, streamed, h, d, t, DTYPE_NAMES[dtype],
                        list(prompt_token_ids) if prompt_token_ids is not None else None,
                        model_fingerprint or None, tuple(names) if names else None, bool(batch),
                        originals=streamed.originals)
