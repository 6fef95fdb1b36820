"""The reference quantizer: plain torch, fp32, the exact operation sequence that spec/FORMAT.md pins.

Every other implementation (the Triton kernels, the fast CPU path) must produce the same integer codes and the
same metadata bits as this module; tests compare them with ``torch.equal``.

For one channel of one chunk of n ≤ C tokens (x in fp32, all steps in fp32, IEEE round-to-nearest-even unless
said otherwise; ``meta()`` is the cast to the scheme's metadata dtype):

    centre = (max(x) + min(x)) * 0.5                 # midrange; or tree_sum(x) / n for "mean"
    offset = meta(centre)                            # round to nearest even
    o      = fp32(offset)
    dev    = max(|x - o|)
    scale  = meta_up(dev)                            # the smallest metadata value >= dev
    s      = fp32(scale)
    u      = (x - o) / s      if s > 0 else 0        # in [-1, 1]
    z      = u                                       # linear, or sign(u) * fp32(log1p(alpha*|u|) / c)
                                                     # with the log1p and the division in float64,
                                                     # c = log1p(alpha) in float64
    v      = (z + 1) * (A / 2)                       # anchor coordinate in [0, A], A = 2**anchor_bits - 1
    a      = clamp(floor(v + 0.5), 0, A)             # nearest anchor level (round half up)
    r      = clamp(floor((v - a + 0.5) * R), 0, R-1) # signed position inside the anchor step, R = 2**residual_bits
    code   = a * R + r

With ``grid = "uniform"`` (the paper preset) the code is instead a plain 8-bit grid over [-1, 1], Q = 255:

    v      = (z + 1) * (Q / 2)
    code   = clamp(floor(v + 0.5), 0, Q);  a = code >> residual_bits;  r = code & (R - 1)

decoded as ``ẑ = code * (2/Q) - 1`` (full) or at the middle of the anchor's bin,
``ẑ = (a * R + (R - 1) / 2) * (2/Q) - 1`` (anchor only).

Decoding (nested grid): ``v̂ = a + ((r + 0.5) / R - 0.5)`` from the full code or ``v̂ = a`` from the anchor alone (the anchor
level itself: the centre of its residual sub-grid, and for a = 0 and a = A the chunk's extremes); with
``extremes = "range"`` the full code's end sub-bins, where the chunk's min and max are encoded
(:func:`end_codes`), decode at ``ẑ = ∓1`` instead, the chunk's range ends; then
``ẑ = v̂ * (2/A) - 1``, ``û = ẑ`` or ``sign(ẑ) * fp32(expm1(|ẑ| * c) / alpha)`` (float64 inside),
``x̂ = o + s * û``.

Keys always run along tokens as above. Values with ``value_axis = "channel"`` are the same
encoding applied to the transpose ``[H, D, T]``: groups of C consecutive channels of one token, metadata
``[H, T, ceil(D/C)]``; the codes stay in ``[H, T, D]`` order. With ``sink_tokens`` S the first S tokens decode
from the full code also when only the anchor is given (the anchor carries their residual). With
``key_rotation = "hadamard"`` the keys are rotated along head_dim first (:func:`lynxkv.quant.rotation
.rotate`: everything above applies to the rotated keys ``y``) and rotated back after decoding, in fp32, before
the cast to the requested dtype (:func:`lynxkv.quant.rotation.unrotate`).

The α-law step runs in float64 and is rounded once to fp32: two correct-to-an-ulp ``log1p`` implementations
(vectorised and scalar, CPU and GPU) then agree on the fp32 ``z`` except in vanishingly rare double-rounding
cases, so the codes are reproducible across implementations.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from lynxkv.errors import InputError, SchemeError
from lynxkv.quant import rotation
from lynxkv.quant.pack import unpack_bits
from lynxkv.quant.scheme import Scheme

META_TORCH_DTYPE = {"fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class EncodedTensor:
    """One quantized ``[H, T, D]`` tensor (the keys or the values of one layer)."""

    anchor: torch.Tensor  # uint8 [H, T, D], values in [0, A]
    residual: torch.Tensor  # uint8 [H, T, D], values in [0, R-1]
    offset: torch.Tensor  # meta dtype: axis "token" [H, ceil(T/C), D]; axis "channel" [H, T, ceil(D/C)]
    scale: torch.Tensor  # meta dtype, the shape of offset, >= 0
    axis: str = "token"  # the axis the groups run along (Scheme.axis)
    sinks: int = 0  # leading tokens decoded from the full code also from the anchor alone (their residual is real)
    rotated: bool = False  # the codes are of the Hadamard-rotated rows (Scheme.rotated): decoding rotates back
    # anchor and residual hold the codes two per byte, uint8 [H, T, D/2] (the 4+4 split, an even D): pack_bits of
    # the [H, T, D] codes, the bytes the page records store (lynxkv.quant.quantize(..., packed=True))
    packed: bool = False

    @property
    def shape(self) -> tuple[int, int, int]:
        h, t, d = self.anchor.shape
        return (h, t, 2 * d if self.packed else d)

    def _with(self, anchor, residual, offset, scale, sinks: int) -> "EncodedTensor":
        return EncodedTensor(anchor, residual, offset, scale, self.axis, sinks, self.rotated, self.packed)

    def unpacked(self) -> "EncodedTensor":
        """The same codes one per byte (itself where they are not packed)."""
        if not self.packed:
            return self
        h, t, d = self.shape
        a, r = (unpack_bits(m.reshape(-1), 4, h * t * d).view(h, t, d) for m in (self.anchor, self.residual))
        return EncodedTensor(a, r, self.offset, self.scale, self.axis, self.sinks, self.rotated)

    def to(self, device: str | torch.device) -> "EncodedTensor":
        return self._with(*(t.to(device) for t in (self.anchor, self.residual, self.offset, self.scale)), self.sinks)

    def tokens(self, start: int, stop: int, chunk: int) -> "EncodedTensor":
        """The tokens ``[start, stop)`` (for groups along tokens ``start`` a multiple of ``chunk``), with their
        metadata rows."""
        if self.axis == "token":
            if start % chunk:
                raise SchemeError(f"slice start {start} is not a multiple of chunk {chunk}")
            m0, m1 = start // chunk, -(-stop // chunk)
        else:
            m0, m1 = start, stop
        return self._with(self.anchor[:, start:stop], self.residual[:, start:stop], self.offset[:, m0:m1],
                          self.scale[:, m0:m1], max(0, min(self.sinks, stop) - start))


def _check_input(x: torch.Tensor, *, finite: bool = True) -> None:
    """Shape and dtype of an input tensor, and (``finite``) that it holds no inf or NaN."""
    if x.dim() != 3:
        raise InputError(f"expected a [kv_heads, tokens, head_dim] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"expected a floating-point tensor, got {x.dtype}")
    if finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise InputError("tensor holds inf or NaN values; only finite KV caches can be quantized")


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` (a power-of-two length) by repeated halving: ``s[i] = s[i] + s[i + n/2]``.

    This fixes the fp32 summation order so that any implementation can reproduce the mean bit for bit.
    """
    n = x.shape[dim]
    while n > 1:
        n //= 2
        x = x.narrow(dim, 0, n) + x.narrow(dim, n, n)
    return x.squeeze(dim)


def meta_round_up(dev: torch.Tensor, meta_dtype: torch.dtype) -> torch.Tensor:
    """The smallest value of ``meta_dtype`` that is >= ``dev`` (``dev`` fp32, non-negative)."""
    if meta_dtype == torch.float32:
        return dev.clone()
    h = dev.to(meta_dtype)
    low = h.float() < dev
    if bool(low.any()):
        bumped = (h.view(torch.int16) + 1).view(meta_dtype)
        h = torch.where(low, bumped, h)
    return h


def _chunked(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, T, D]`` fp32 → (``[H, nc, C, D]`` padded by repeating each chunk's last valid token,
    valid-count ``[nc]``)."""
    h, t, d = x.shape
    nc = -(-t // chunk)
    pad = nc * chunk - t
    if pad:
        x = torch.cat([x, x[:, -1:, :].expand(h, pad, d)], dim=1)
    counts = torch.full((nc,), chunk, dtype=torch.int64, device=x.device)
    if pad:
        counts[-1] = chunk - pad
    return x.view(h, nc, chunk, d), counts


def chunk_meta(x: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(head, chunk, channel) ``offset`` and ``scale`` (metadata dtype, ``[H, ceil(T/C), D]``) of ``x``
    ``[H, T, D]``, ``T > 0``."""
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    xc, counts = _chunked(x.float(), scheme.chunk)  # [H, nc, C, D]
    if scheme.centring == "midrange":
        centre = (xc.amax(dim=2) + xc.amin(dim=2)) * 0.5  # [H, nc, D]
    else:
        valid = (torch.arange(scheme.chunk, device=x.device)[None, :] < counts[:, None]).to(torch.float32)
        masked = xc * valid[None, :, :, None]  # [nc, C] mask: the padding counts as zeros
        centre = tree_sum(masked, dim=2) / counts.to(torch.float32)[None, :, None]
    offset = centre.to(meta_dtype)
    if not bool(torch.isfinite(offset).all()):
        raise InputError(f"chunk centre overflows the {scheme.meta_dtype} metadata; values are too large")
    dev = (xc - offset.float().unsqueeze(2)).abs().amax(dim=2)
    scale = meta_round_up(dev, meta_dtype)
    if not bool(torch.isfinite(scale).all()):
        raise InputError(f"chunk range overflows the {scheme.meta_dtype} metadata; values are too large")
    return offset, scale


TokenQuantizer = Callable[[torch.Tensor, Scheme], EncodedTensor]


Encoder = Callable[[torch.Tensor, Scheme, str, bool], EncodedTensor]


def quantize(x: torch.Tensor, scheme: Scheme, kind: str = "key", *,
             along_tokens: TokenQuantizer | None = None, encoder: Encoder | None = None) -> EncodedTensor:
    """Quantize ``x`` ``[H, T, D]`` (any float dtype), the keys (``kind="key"``) or the values of one layer, with
    ``scheme``: groups along ``scheme.axis(kind)``, the first ``scheme.sink_tokens`` tokens marked as sinks, the
    rows rotated first where ``scheme.rotated(kind)`` (:func:`lynxkv.quant.rotation.rotate`).

    ``along_tokens(x, scheme)`` is the implementation of the token-axis encoding (default: this module's); a
    channel-axis tensor is that encoding of the transpose and rotated rows are that encoding of the rotation, so
    every implementation shares these rules, unless ``encoder(x, scheme, axis, rotated)`` does the whole
    encoding itself (the fast CPU path: values per channel read in place, keys rotated inside its pass; its codes
    equal these rules'). Each implementation refuses inf and NaN itself (this module's before it computes, the
    compiled ones in their metadata pass), so the input is read for that once."""
    _check_input(x, finite=False)
    axis, rotated = scheme.axis(kind), scheme.rotated(kind)
    try:
        if encoder is not None:
            enc = encoder(x, scheme, axis, rotated)
        else:
            encode = along_tokens or quantize_tokens
            y = rotation.rotate(x) if rotated else x
            if axis == "channel":
                enc = encode(y.transpose(1, 2).contiguous(), scheme)  # [H, D, T]: chunks of C channels per token
                enc = EncodedTensor(*(t.transpose(1, 2).contiguous() for t in (enc.anchor, enc.residual, enc.offset,
                                                                                 enc.scale)), axis="channel")
            else:
                enc = encode(y, scheme)
    except InputError:
        if rotated and bool(torch.isfinite(x).all()) and not bool(torch.isfinite(rotation.rotate(x)).all()):
            raise rotation.overflow_error() from None
        raise
    return dataclasses.replace(enc, sinks=min(scheme.sink_tokens, x.shape[1]), rotated=rotated)


def quantize_tokens(x: torch.Tensor, scheme: Scheme) -> EncodedTensor:
    """The encoding of spec/FORMAT.md §9.2: chunks run along the token axis of ``x`` ``[H, T, D]``."""
    _check_input(x)
    h, t, d = x.shape
    meta_dtype = META_TORCH_DTYPE[scheme.meta_dtype]
    if t == 0:
        empty_meta = torch.empty((h, 0, d), dtype=meta_dtype, device=x.device)
        empty_codes = torch.empty((h, 0, d), dtype=torch.uint8, device=x.device)
        return EncodedTensor(empty_codes, empty_codes.clone(), empty_meta, empty_meta.clone())
    offset, scale = chunk_meta(x, scheme)
    o, s = spread(offset, scheme.chunk, "token", t, d), spread(scale, scheme.chunk, "token", t, d)
    diff = x.float() - o
    u = torch.where(s > 0, diff / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(diff))
    a, r = codes_of_u(u, scheme)
    return EncodedTensor(a.contiguous(), r.contiguous(), offset.contiguous(), scale.contiguous())


def spread(meta: torch.Tensor, chunk: int, axis: str, t: int, d: int) -> torch.Tensor:
    """Per-group metadata as fp32 ``[H, T, D]``, one value per element."""
    if axis == "token":
        return meta.float().repeat_interleave(chunk, dim=1)[:, :t]
    return meta.float().repeat_interleave(chunk, dim=2)[:, :, :d]


def codes_of_u(u: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor and residual (uint8) of normalised values ``u`` in ``[-1, 1]`` (fp32): compand, then round."""
    z = compand(u, scheme)
    A = float(scheme.anchor_steps)
    R = float(scheme.residual_levels)
    if scheme.grid == "uniform":
        Q = float(scheme.code_steps)
        code = torch.clamp(torch.floor((z + 1.0) * (Q / 2.0) + 0.5), 0.0, Q).to(torch.uint8)
        return split_code(code, scheme)
    v = (z + 1.0) * (A / 2.0)
    a = torch.clamp(torch.floor(v + 0.5), 0.0, A)
    r = torch.clamp(torch.floor((v - a + 0.5) * R), 0.0, R - 1.0)
    return a.to(torch.uint8), r.to(torch.uint8)


def compand(u: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The compander ``[-1, 1] -> [-1, 1]`` (fp32 in, fp32 out; α-law computed in float64)."""
    if scheme.compander == "linear":
        return u
    mag = torch.log1p(u.double().abs() * scheme.alpha) / math.log1p(scheme.alpha)
    return torch.sign(u) * mag.float()


def expand(z: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The inverse of :func:`compand` (fp32 in, fp32 out; α-law computed in float64)."""
    if scheme.compander == "linear":
        return z
    mag = torch.expm1(z.double().abs() * math.log1p(scheme.alpha)) / scheme.alpha
    return torch.sign(z) * mag.float()


def dequantize(
    enc: EncodedTensor,
    scheme: Scheme,
    *,
    anchor_only: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reconstruct ``[H, T, D]`` from anchor + residual (full) or from the anchor alone (and the residual of the
    ``enc.sinks`` leading tokens); rows of rotated codes (``enc.rotated``) are rotated back in fp32, then cast."""
    enc = enc.unpacked()
    h, t, d = enc.anchor.shape
    if t == 0:
        return torch.empty((h, 0, d), dtype=dtype, device=enc.anchor.device)
    uhat = expanded_levels(enc.anchor, None if anchor_only else enc.residual, scheme)
    if anchor_only and enc.sinks:
        n = enc.sinks
        uhat[:, :n] = expanded_levels(enc.anchor[:, :n], enc.residual[:, :n], scheme)
    o = spread(enc.offset, scheme.chunk, enc.axis, t, d)
    s = spread(enc.scale, scheme.chunk, enc.axis, t, d)
    y = o + s * uhat
    return (rotation.unrotate(y) if enc.rotated else y).to(dtype)


def expanded_levels(anchor: torch.Tensor, residual: torch.Tensor | None, scheme: Scheme) -> torch.Tensor:
    """``û`` (fp32, in ``[-1, 1]`` up to half a step) of anchor codes with their residuals, or of anchor codes
    alone (``residual`` None); applied to every code value it is the decoder's 256-entry level table."""
    A = float(scheme.anchor_steps)
    R = float(scheme.residual_levels)
    if scheme.grid == "uniform":
        Q = float(scheme.code_steps)
        if residual is None:
            q = anchor.float() * R + (R - 1.0) / 2.0
        else:
            q = join_code(anchor, residual, scheme).float()
        zhat = q * (2.0 / Q) - 1.0
    else:
        v = anchor.float()
        if residual is not None:
            v = v + ((residual.float() + 0.5) / R - 0.5)
        zhat = v * (2.0 / A) - 1.0
        if residual is not None and scheme.extremes == "range":
            low, high = end_codes(anchor, residual, scheme)
            zhat = torch.where(low, -1.0, torch.where(high, 1.0, zhat))
    return expand(zhat, scheme)


def end_codes(anchor: torch.Tensor, residual: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the nested grid's end sub-bins, where a chunk's min (``(0, R/2)``: ``v`` in ``[0, 1/R)``) and max
    (``(A, R/2 - 1)``: ``[A - 1/R, A)``, and ``(A, R/2)``: ``v = A``) are encoded; with ``extremes = "range"`` the
    full code decodes them at ``ẑ = -1`` and ``ẑ = 1``, the chunk's ``o - s`` and ``o + s``."""
    a, r = anchor.to(torch.int32), residual.to(torch.int32)
    half, top = scheme.residual_levels // 2, scheme.anchor_steps
    return (a == 0) & (r == half), (a == top) & ((r == half - 1) | (r == half))


def error_bound(enc: EncodedTensor, scheme: Scheme, *, anchor_only: bool = False) -> torch.Tensor:
    """Per-element bound on ``|x̂ - x|`` in fp32 (spec/FORMAT.md, "Error bound"), shape ``[H, T, D]``.

    Linear, nested grid: ``s / (A·R)`` for the full code and ``s / A`` for the anchor; uniform grid: ``s / Q`` and
    ``s · R / Q`` (half a bin, the anchor being decoded at its bin's middle). α-law multiplies by the largest slope
    of the expander over the reachable ``|ẑ| <= 1 + step``, ``c·exp(c·(1 + step))/α``, where ``step`` is the
    linear bound in z units (a top-level anchor may carry a residual just above z = 1). With ``extremes = "range"``
    the full code's end sub-bins (:func:`end_codes`) decode at their outer edge, a whole sub-bin from the far
    side: ``2·s / (A·R)`` there. A slack of ``2^-20·(|o| + s)`` covers fp32 rounding.

    Rotated keys (``enc.rotated``): with ``e`` that bound of the rotated rows and ``ŷ`` their fp32 decoding, the
    bound of element ``i`` of a block of ``b = 2^m`` channels is ``2^(k-m)·Σe + (m+1)·2^-23·2^k·Σ(|ŷ| + e) +
    2^-126``, the sums over the block (docs/format.md, "Error bound", derives it): the butterfly's entries are ±1 and its
    fp32 rounding, in the encoder's and the decoder's, is ``m`` relative roundings deep.
    """
    h, t, d = enc.anchor.shape
    o = spread(enc.offset, scheme.chunk, enc.axis, t, d)
    s = spread(enc.scale, scheme.chunk, enc.axis, t, d)
    step = torch.full((1, t, 1), _step(scheme, anchor_only), device=o.device)
    if anchor_only and enc.sinks:
        step[:, :enc.sinks] = _step(scheme, False)  # the sinks decode from the full code
    if scheme.extremes == "range":  # the end sub-bins of the full code decode at their outer edge: a whole sub-bin
        low, high = end_codes(enc.anchor, enc.residual, scheme)
        ends = low | high
        if anchor_only:
            ends[:, enc.sinks:] = False
        step = torch.where(ends, _step(scheme, False, end=True), step.expand(h, t, d))
    bound = s * step + 2.0**-20 * (o.abs() + s)
    if not enc.rotated:
        return bound
    k, back = rotation.shifts(d)
    b, m = rotation.block_size(d), k + back
    yhat = dequantize(dataclasses.replace(enc, rotated=False), scheme, anchor_only=anchor_only)

    def block_sums(v: torch.Tensor) -> torch.Tensor:  # float64, each element the sum over its block
        return v.double().view(h, t, d // b, b).sum(-1, keepdim=True).expand(h, t, d // b, b).reshape(h, t, d)

    e_sum, y_sum = block_sums(bound), block_sums(yhat.abs())
    return (2.0 ** (k - m) * e_sum + (m + 1) * 2.0**-23 * 2.0**k * (y_sum + e_sum) + 2.0**-126).float()


def _step(scheme: Scheme, anchor_only: bool, *, end: bool = False) -> float:
    """The bound's step in z units (times the expander's largest slope for the α-law); ``end``: an end sub-bin of
    the full code decoded at the chunk's extreme (``extremes = "range"``), a whole sub-bin ``2/(A·R)``."""
    A = float(scheme.anchor_steps)
    R = float(scheme.residual_levels)
    if scheme.grid == "uniform":
        Q = float(scheme.code_steps)
        step = R / Q if anchor_only else 1.0 / Q
    else:
        step = 1.0 / A if anchor_only else (2.0 if end else 1.0) / (A * R)
    if scheme.compander == "alpha":
        c = math.log1p(scheme.alpha)
        step *= c * math.exp(c * (1.0 + step)) / scheme.alpha
    return step


def join_code(anchor: torch.Tensor, residual: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The 8-bit code ``anchor · R + residual``."""
    return (anchor.to(torch.int32) * scheme.residual_levels + residual.to(torch.int32)).to(torch.uint8)


def split_code(code: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`join_code`: high ``anchor_bits`` and low ``residual_bits``."""
    c = code.to(torch.int32)
    return (c >> scheme.residual_bits).to(torch.uint8), (c & (scheme.residual_levels - 1)).to(torch.uint8)
