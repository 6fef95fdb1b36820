"""The quantizer entry: one place that chooses the implementation, by device and scheme.

- CUDA tensors stay on the GPU: the Triton kernels where they support the scheme (:mod:`lynxkv.kernels`:
  encoding: the linear compander, along tokens (values per channel as their transpose); decoding: any 4+4
  scheme through the reference's level table, sink tokens included), else the torch reference on the GPU.
- CPU tensors take the compiled fast path (:mod:`lynxkv.quant.fast`, every scheme) where its C kernels were
  built, else the reference.
- Rotated keys: the compiled CPU encode rotates each block of keys inside its pass; elsewhere
  :func:`quantize` rotates them (:mod:`lynxkv.quant.rotation`, through the reference's one rule) before the
  token-axis encoding runs; the decoders rotate them back (the compiled CPU decode in its own pass, Triton through
  the torch rotation on the GPU).

Every choice gives the reference's codes, metadata and decoded values bit for bit (the tests hold the fast
path and the kernels to :mod:`lynxkv.quant.reference`; a GPU's float64 ``log1p`` may differ from the CPU's by an
ulp, which changes a code in vanishingly rare double-rounding cases). The packed functions give the bytes of
the ``.lynx`` page records (spec/FORMAT.md, "Packing") straight from the tensor and back.
"""

from __future__ import annotations

import functools
import sys

import torch

from lynxkv.errors import InputError
from lynxkv.quant import fast, pack, reference
from lynxkv.quant.device_pages import dequantize_pages_on_device
from lynxkv.quant.reference import EncodedTensor
from lynxkv.quant.scheme import Scheme


@functools.lru_cache(maxsize=1)
def _triton():
    """``(encode, decode)`` kernel modules, or None where Triton does not import."""
    try:
        from lynxkv.kernels import decode, encode
    except ImportError:  # Triton is optional
        return None
    return encode, decode


def _fast_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and fast.available()


def quantize(x: torch.Tensor, scheme: Scheme, kind: str = "key", *, packed: bool = False,
             threads: int | None = None) -> EncodedTensor:
    """Quantize ``x`` ``[H, T, D]`` (fp32/fp16/bf16), the keys (``kind="key"``) or the values of one layer, on its
    device: anchor and residual codes, metadata (groups along ``scheme.axis(kind)``). ``packed``: the codes two
    per byte (:attr:`EncodedTensor.packed`, from :func:`quantize_packed`'s fused pass) where the scheme packs
    them that way (the 4+4 split, an even head_dim), else one per byte as without it. ``threads`` caps the
    packed CPU pass's worker threads (e.g. 1 where layers are quantized side by side)."""
    if packed and x.dim() == 3 and fast.packable(scheme, x.shape[2]):
        if not x.is_floating_point():
            raise InputError(f"expected a floating-point tensor, got {x.dtype}")
        h, t, d = x.shape
        a, r, offset, scale = quantize_packed(x, scheme, kind, threads=threads)
        return EncodedTensor(a.view(h, t, d // 2), r.view(h, t, d // 2), offset, scale, scheme.axis(kind),
                             min(scheme.sink_tokens, t), scheme.rotated(kind), packed=True)
    if _fast_cpu(x):  # one compiled pass along either axis: values per channel read in place, keys rotated in it
        return reference.quantize(x, scheme, kind, encoder=fast.quantize)
    kernels = _triton() if x.is_cuda else None
    triton = kernels[0].quantize_triton if kernels is not None and kernels[0].supports(scheme) else None
    return reference.quantize(x, scheme, kind, along_tokens=triton)  # Triton along tokens, or the reference


def dequantize(enc: EncodedTensor, scheme: Scheme, *, anchor_only: bool = False, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``[H, T, D]`` in ``dtype`` from anchor + residual, or from the anchor alone (and the residual of the
    ``enc.sinks`` leading tokens); into ``out`` when given (a preallocated tensor of that shape, e.g. a slice of a
    whole cache, written in place). ``threads`` caps the CPU worker threads (e.g. 1 beside a model that is
    decoding)."""
    enc = enc.unpacked()
    if enc.anchor.is_cuda and _triton() is not None and _triton()[1].supports(scheme) and fast.packable(scheme,
                                                                                                     enc.shape[2]):
        y = out if out is not None else torch.empty(enc.shape, dtype=dtype, device=enc.anchor.device)
        if y.stride(-1) == 1 and y.dtype in (torch.float32, torch.bfloat16, torch.float16):
            a, r = pack.pack_bits(enc.anchor, 4), pack.pack_bits(enc.residual, 4)
            _triton()[1].decode(a.view(1, -1), r.view(1, -1), enc.offset.contiguous().unsqueeze(0),
                                enc.scale.contiguous().unsqueeze(0), scheme, y.unsqueeze(0),
                                kind="value" if enc.axis == "channel" else "key", anchor_only=anchor_only,
                                sinks=enc.sinks, rotated=enc.rotated)
            return y
    if not (_fast_cpu(enc.anchor) and (out is None or out.device.type == "cpu")):
        res = reference.dequantize(enc, scheme, anchor_only=anchor_only, dtype=dtype if out is None else out.dtype)
        return res if out is None else _into(out, res)
    if out is None:
        out = torch.empty(enc.shape, dtype=dtype)
    _fast_dequantize(enc, scheme, anchor_only, out, threads)
    if anchor_only and enc.sinks:  # then the sink tokens again, from the full code
        _fast_dequantize(enc.tokens(0, enc.sinks, scheme.chunk), scheme, False, out[:, :enc.sinks], threads)
    return out


def _fast_dequantize(enc: EncodedTensor, scheme: Scheme, anchor_only: bool, out: torch.Tensor,
                     threads: int | None) -> torch.Tensor:
    """The fast CPU path, which decodes groups along tokens (rotated keys rotated back in the same pass): a
    channel-axis tensor as its transpose."""
    if enc.axis == "channel" and enc.rotated:  # no scheme rotates its values: the reference, not a second kernel
        return _into(out, reference.dequantize(enc, scheme, anchor_only=anchor_only, dtype=out.dtype))
    if enc.axis == "channel":
        t = EncodedTensor(*(None if m is None else m.transpose(1, 2)  # residual None: the anchor alone
                            for m in (enc.anchor, enc.residual, enc.offset, enc.scale)))
        fast.dequantize(t, scheme, anchor_only=anchor_only, out=out.transpose(1, 2), threads=threads)
        return out
    return fast.dequantize(enc, scheme, anchor_only=anchor_only, out=out, threads=threads)


def concurrent_tensors(threads: int | None = None) -> int:
    """How many tensors a CPU caller may decode at once, each with ``threads=1`` (one layer per worker, no
    barrier between the halves of every call: what ``load_kv`` does): the fast path's worker count (``threads``,
    default ``LYNXKV_CPU_THREADS`` or torch's thread count), or 1 for the reference, which torch parallelises
    inside each operation."""
    return max(1, threads or fast.workers()) if fast.available() else 1


def quantize_packed(x: torch.Tensor, scheme: Scheme, kind: str = "key", *,
                    threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(anchor_bytes, residual_bytes, offset, scale)`` of ``x`` ``[H, T, D]``: the codes packed over the
    ``[H, T, D]`` flattening (``pack_bits`` of :func:`quantize`'s anchor and residual), on ``x``'s device. For
    a 4+4 split and an even head_dim, token ``t``'s bytes are ``[h, t, :]`` of the ``[H, T, D/2]`` view, so a
    page record is a slice."""
    h, t, d = x.shape if x.dim() == 3 else (0, 0, 0)
    if x.is_cuda:
        kernels = _triton()
        if (scheme.axis(kind) == "token" and not scheme.rotated(kind) and kernels is not None
                and kernels[0].supports(scheme) and fast.packable(scheme, d)):  # Triton's fused path: unrotated keys
            a, r, o, s = kernels[0].encode(x.unsqueeze(0), scheme, pack=True)
            return a[0], r[0], o[0], s[0]
    elif _fast_cpu(x) and x.dim() == 3 and fast.packable(scheme, d):
        return fast.quantize_packed(x, scheme, axis=scheme.axis(kind), rotated=scheme.rotated(kind), threads=threads)
    enc = quantize(x, scheme, kind)
    return (pack_bits(enc.anchor, scheme.anchor_bits), pack_bits(enc.residual, scheme.residual_bits), enc.offset,
            enc.scale)


def dequantize_packed(anchor: torch.Tensor, residual: torch.Tensor | None, offset: torch.Tensor, scale: torch.Tensor,
                      shape: tuple[int, int, int], scheme: Scheme, *, kind: str = "key",
                      dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                      threads: int | None = None) -> torch.Tensor:
    """The inverse of :func:`quantize_packed`: ``[H, T, D]`` from packed anchor bytes (+ residual bytes, or
    ``None`` for the anchor alone: every token, sink tokens too, from its anchor code) and the metadata, into
    ``out`` when given. (The sink tokens' full code from the anchor is :func:`dequantize`'s, which sees the
    residual of the sinks in its :class:`EncodedTensor`.) Keys of a rotating scheme are rotated back."""
    h, t, d = shape
    dtype = dtype if out is None else out.dtype
    axis, rotated = scheme.axis(kind), scheme.rotated(kind)
    if anchor.is_cuda:
        kernels = _triton()
        if kernels is not None and kernels[1].supports(scheme) and fast.packable(scheme, d):
            y = out if out is not None else torch.empty(shape, dtype=dtype, device=anchor.device)
            kernels[1].decode(anchor.reshape(1, -1), None if residual is None else residual.reshape(1, -1),
                              offset.unsqueeze(0), scale.unsqueeze(0), scheme, y.unsqueeze(0), kind=kind,
                              rotated=rotated)
            return y
    elif axis == "token" and _fast_cpu(anchor) and fast.packable(scheme, d):  # the fused CPU path: along tokens
        return fast.dequantize_packed(anchor, residual, offset, scale, shape, scheme, dtype=dtype, out=out,
                                      threads=threads, rotated=rotated)
    n = h * t * d
    a = unpack_bits(anchor, scheme.anchor_bits, n).view(shape)
    r = torch.zeros_like(a) if residual is None else unpack_bits(residual, scheme.residual_bits, n).view(shape)
    return dequantize(EncodedTensor(a, r, offset, scale, axis, rotated=rotated), scheme, anchor_only=residual is None,
                      dtype=dtype, out=out, threads=threads)


def dequantize_pages(anchor, residual, pages, scheme: Scheme, *, out: torch.Tensor, threads: int | None = None,
                     kind: str = "key") -> int:
    """Dequantize pages of bit-packed codes held in byte buffers (e.g. ``.lynx`` page records) straight into
    ``out`` ``[H, T, D]`` (written in place, any strides).

    ``pages``: rows ``(offset_at, scale_at, anchor_at, residual_at, t0, n)``: the page holds tokens
    ``[t0, t0 + n)``; its offsets and scales (``[H, ceil(n/C), D]``, little-endian metadata dtype) start at
    bytes ``offset_at`` and ``scale_at`` of ``anchor``, its anchor codes (``pack_bits`` of ``[H, n, D]``) at
    ``anchor_at``, its residual codes at ``residual_at`` of ``residual`` (``None``: the anchor alone). A row of
    eight, ``(..., t0, n, held, residual_held)``, decodes the first ``n`` tokens of each head from arrays that
    hold ``held`` (metadata, anchor codes) and ``residual_held`` (residual codes) tokens per head. Returns
    metadata problem flags: 1 an offset is not finite, 2 a scale is not finite, 4 a scale is negative (the
    caller decides; the values written for such a page are what the arithmetic gives). The fast CPU path
    decodes the 4+4 split in one compiled pass (the rotated keys rotated back in it); every other
    device and split decodes on ``out``'s device (:mod:`lynxkv.quant.device_pages`: the record bytes copied there
    once, the Triton kernels on CUDA, the reference elsewhere). ``kind`` (``"key"`` or ``"value"``) fixes,
    through the scheme, the axis the groups run along (``scheme.axis``: along tokens, or along the channels of
    each token for values per channel, metadata ``[H, n, ceil(D/C)]``) and whether the rows are rotated
    (``scheme.rotated``). Sink tokens are the caller's: every token decodes from the codes given."""
    h, t, d = out.shape
    axis, rotated = scheme.axis(kind), scheme.rotated(kind)
    if _fast_cpu(out) and fast.packable(scheme, d):
        return fast.dequantize_pages(anchor, residual, pages, scheme, out=out, threads=threads, axis=axis,
                                     rotated=rotated)
    return dequantize_pages_on_device(anchor, residual, pages, scheme, out=out, kind=kind, entry=sys.modules[__name__])


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``values`` (each < 2**bits) into ``ceil(numel·bits/8)`` bytes (spec/FORMAT.md, "Packing")."""
    if bits == 4 and _fast_cpu(values) and values.numel() % 2 == 0 and values.dtype == torch.uint8:
        return fast.pack4(values)  # any strided [H, n, D] view with an even D is read in place
    return pack.pack_bits(values, bits)


def unpack_bits(packed: torch.Tensor | bytes | memoryview, bits: int, count: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: ``count`` uint8 values (a wrong payload size is a FormatError)."""
    if (bits == 4 and isinstance(packed, torch.Tensor) and _fast_cpu(packed) and count % 2 == 0
            and packed.numel() == count // 2 and packed.dtype == torch.uint8):
        return fast.unpack4(packed)
    return pack.unpack_bits(packed, bits, count)


def _into(out: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    if tuple(out.shape) != tuple(res.shape):
        raise InputError(f"out: expected shape {tuple(res.shape)}, got {tuple(out.shape)}")
    return out.copy_(res)
