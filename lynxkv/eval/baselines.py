"""One registry of KV codecs, lynx schemes and the usual baselines behind the same two-member interface.

A codec is anything with ``roundtrip(x [H, T, D]) -> x̂ [H, T, D]`` (fp32 in, fp32 out) and
``bits_per_element(shape)`` (payload plus every scale/offset it must store, averaged over the elements of a
tensor of that shape). Metadata is rounded to its storage dtype before use, so the error is what a decoder
would really see.

Baselines (the storage dtype of each scale/zero in brackets):

- ``fp32``: the exact cache (identity), the noise floor of every measurement;
- ``bf16``: a plain cast;
- ``fp8-e4m3``: vLLM's FP8 KV cache, one per-tensor scale ``amax/448`` [fp32], ``torch.float8_e4m3fn``;
- ``int8-tensor`` / ``int4-tensor``: symmetric, one scale ``amax/(2^(b-1)-1)`` per tensor [fp32]: the paper's
  "INT8/INT4";
- ``int8-g64`` / ``int4-g64``: asymmetric min/max over contiguous groups of 64 elements of the ``[H, T, D]``
  layout [fp16 scale + fp16 zero], i.e. per token and head when D = 64: what HF ``QuantizedCache`` does with
  its defaults (quanto backend, ``axis=0``, ``q_group_size=64``), without its full-precision recent window;
- ``kivi4`` / ``kivi2``: KIVI: keys asymmetric per channel over groups of 32 tokens, values asymmetric per
  token over groups of 32 channels [fp16 scale + fp16 zero], also without KIVI's full-precision recent window;
- ``lynx-*``: a :class:`~lynxkv.quant.scheme.Scheme` through the quantizer entry, full code or anchor only
  (earlier defaults, named by the development format version that made them the default: ``lynx-1.3``, the
  full code's end sub-bins decoded at their midpoints; ``lynx-1.2``, α = 1, values per channel, 4 sink tokens,
  keys not rotated; ``lynx-alpha1-1.0``, values per token and no sink tokens either); ``lynx-plain-keys``, the
  second candidate of the choice per cache (the default with its keys not rotated); ``lynx-chosen``, the candidate
  chosen per prompt on its own cache (:mod:`lynxkv.hf.choose`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lynxkv.errors import InputError
from lynxkv.hf.choose import CANDIDATES
from lynxkv.quant import dequantize, quantize
from lynxkv.quant.scheme import Scheme, get_scheme

Shape = tuple[int, int, int]


class Codec(Protocol):
    name: str

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor: ...

    def bits_per_element(self, shape: Shape) -> float: ...


def _numel(shape: Shape) -> int:
    return max(shape[0] * shape[1] * shape[2], 1)


@dataclass(frozen=True)
class Identity:
    name: str = "fp32"
    description: str = "exact cache (fp32)"

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().clone()

    def bits_per_element(self, shape: Shape) -> float:
        return 32.0


@dataclass(frozen=True)
class Cast:
    name: str
    dtype: torch.dtype
    bits: int
    description: str

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).float()

    def bits_per_element(self, shape: Shape) -> float:
        return float(self.bits)


FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8PerTensor:
    """``x̂ = fp8(x / s) · s`` with ``s = amax / 448`` (the largest finite e4m3fn value)."""

    name: str = "fp8-e4m3"
    description: str = "FP8 e4m3, per-tensor scale amax/448 (vLLM)"

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        amax = float(x.abs().max()) if x.numel() else 0.0
        if amax == 0.0:
            return torch.zeros_like(x)
        s = amax / FP8_E4M3_MAX
        return (x / s).to(torch.float8_e4m3fn).float() * s

    def bits_per_element(self, shape: Shape) -> float:
        return 8.0 + 32.0 / _numel(shape)


@dataclass(frozen=True)
class IntPerTensor:
    """Symmetric: ``q = clamp(round(x/s), −M, M)``, ``M = 2^(b−1) − 1``, ``s = amax/M``."""

    name: str
    bits: int
    description: str

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        m = float((1 << (self.bits - 1)) - 1)
        amax = float(x.abs().max()) if x.numel() else 0.0
        if amax == 0.0:
            return torch.zeros_like(x)
        s = amax / m
        return torch.clamp(torch.round(x / s), -m, m) * s

    def bits_per_element(self, shape: Shape) -> float:
        return self.bits + 32.0 / _numel(shape)


def minmax_roundtrip(xg: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min/max quantization of ``xg`` with one (scale, zero) per slice along ``dim``.

    ``s = fp16((max − min) / (2^b − 1))``, ``z = fp16(min)``, ``q = clamp(round((x − z)/s), 0, 2^b − 1)``,
    ``x̂ = q·s + z``; both metadata values are stored in fp16 and used as stored.
    """
    levels = float((1 << bits) - 1)
    lo = xg.amin(dim=dim, keepdim=True)
    hi = xg.amax(dim=dim, keepdim=True)
    s = ((hi - lo) / levels).to(torch.float16).float()
    z = lo.to(torch.float16).float()
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.clamp(torch.round((xg - z) / s_safe), 0.0, levels)
    return torch.where(s > 0, q * s + z, z.expand_as(xg))


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> tuple[torch.Tensor, int]:
    """Pad ``x`` along ``dim`` to a multiple by repeating its last slice (which leaves min/max unchanged)."""
    n = x.shape[dim]
    pad = -n % multiple
    if pad:
        last = x.narrow(dim, n - 1, 1)
        x = torch.cat([x, last.expand(*[pad if i == dim else s for i, s in enumerate(x.shape)])], dim=dim)
    return x, n


@dataclass(frozen=True)
class IntGroups:
    """Asymmetric over contiguous groups of ``group`` elements of the flattened ``[H, T, D]`` layout."""

    name: str
    bits: int
    description: str
    group: int = 64

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        flat, n = _pad_to(x.float().reshape(-1), 0, self.group)
        out = minmax_roundtrip(flat.view(-1, self.group), self.bits, dim=1)
        return out.reshape(-1)[:n].view_as(x)

    def bits_per_element(self, shape: Shape) -> float:
        groups = -(-_numel(shape) // self.group)
        return self.bits + 32.0 * groups / _numel(shape)


@dataclass(frozen=True)
class KiviHalf:
    """One half of KIVI: keys per channel over ``group`` tokens (``axis="token"`` groups tokens), values per
    token over ``group`` channels (``axis="channel"``)."""

    bits: int
    axis: str  # "token": groups of tokens per channel (keys); "channel": groups of channels per token (values)
    group: int = 32

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        h, t, d = x.shape
        if self.axis == "token":
            xp, n = _pad_to(x, 1, self.group)
            out = minmax_roundtrip(xp.view(h, -1, self.group, d), self.bits, dim=2)
            return out.view(h, -1, d)[:, :n]
        xp, n = _pad_to(x, 2, self.group)
        out = minmax_roundtrip(xp.view(h, t, -1, self.group), self.bits, dim=3)
        return out.view(h, t, -1)[:, :, :n]

    def bits_per_element(self, shape: Shape) -> float:
        h, t, d = shape
        groups = h * d * -(-t // self.group) if self.axis == "token" else h * t * -(-d // self.group)
        return self.bits + 32.0 * groups / _numel(shape)


@dataclass(frozen=True)
class Kivi:
    """KIVI with ``bits``: keys and values take different group axes, so the codec sees which it gets."""

    name: str
    bits: int
    description: str
    group: int = 32

    def for_kind(self, kind: str) -> KiviHalf:
        return KiviHalf(self.bits, "token" if kind == "key" else "channel", self.group)

    def roundtrip(self, x: torch.Tensor, kind: str = "key") -> torch.Tensor:
        return self.for_kind(kind).roundtrip(x)

    def bits_per_element(self, shape: Shape, kind: str = "key") -> float:
        return self.for_kind(kind).bits_per_element(shape)


@dataclass(frozen=True)
class Lynx:
    """A lynx scheme through the reference quantizer; ``anchor_only`` decodes from the high bits alone."""

    name: str
    scheme: Scheme
    anchor_only: bool = False

    @property
    def description(self) -> str:
        return f"lynx {'anchor' if self.anchor_only else 'full'}: {self.scheme.describe()}"

    def roundtrip(self, x: torch.Tensor, kind: str = "key") -> torch.Tensor:
        return dequantize(quantize(x, self.scheme, kind), self.scheme, anchor_only=self.anchor_only)

    def bits_per_element(self, shape: Shape, kind: str = "key") -> float:
        """Keys and values averaged (the scheme's own accounting, sink tokens included)."""
        return self.scheme.bits_per_element(anchor_only=self.anchor_only, tokens=shape[1], head_dim=shape[2])


@dataclass(frozen=True)
class ChosenLynx:
    """The scheme chosen per cache (:func:`lynxkv.hf.choose.choose_scheme`): per prompt, the evaluation makes the
    choice on the prompt's own cache and :meth:`bind` returns the :class:`Lynx` codec of the chosen scheme, under
    this name."""

    name: str
    anchor_only: bool = False
    description: str = "lynx, the scheme chosen per cache by the model's KL on the prompt's last tokens"

    def bind(self, choice) -> Lynx:
        """The codec of the scheme of ``choice`` (a :class:`lynxkv.hf.choose.Choice`)."""
        return Lynx(self.name, choice.scheme, self.anchor_only)


def roundtrip_kv(codec, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``codec.roundtrip`` for keys (``kind="key"``) or values, passing the kind to codecs that need it."""
    return codec.roundtrip(x, kind) if isinstance(codec, (Kivi, Lynx)) else codec.roundtrip(x)


def roundtrip_cache(codec, kv):
    """Every layer's keys and values of ``kv`` (per layer ``(keys, values)``) through ``codec``."""
    return [(roundtrip_kv(codec, k, "key"), roundtrip_kv(codec, v, "value")) for k, v in kv]


def bits_kv(codec, shape: Shape, kind: str) -> float:
    return codec.bits_per_element(shape, kind) if isinstance(codec, (Kivi, Lynx)) else codec.bits_per_element(shape)


def lynx_pair(name: str, scheme: Scheme) -> list[Lynx]:
    """The full code and the anchor alone of one scheme: ``name`` and ``name-anchor``."""
    return [Lynx(name, scheme), Lynx(f"{name}-anchor", scheme, anchor_only=True)]


def _baselines() -> list:
    return [
        Identity(),
        Cast("bf16", torch.bfloat16, 16, "bfloat16 cast"),
        Fp8PerTensor(),
        IntPerTensor("int8-tensor", 8, "INT8 symmetric, per-tensor scale"),
        IntPerTensor("int4-tensor", 4, "INT4 symmetric, per-tensor scale"),
        IntGroups("int8-g64", 8, "INT8 asymmetric, groups of 64 per token (HF QuantizedCache)"),
        IntGroups("int4-g64", 4, "INT4 asymmetric, groups of 64 per token (HF QuantizedCache)"),
        Kivi("kivi4", 4, "KIVI 4-bit: K per channel/32 tokens, V per token/32 channels"),
        Kivi("kivi2", 2, "KIVI 2-bit: K per channel/32 tokens, V per token/32 channels"),
    ]


def _lynx_codecs() -> list:
    default = get_scheme("default")
    codecs = lynx_pair("lynx-default", default)
    codecs += lynx_pair("lynx-plain-keys", CANDIDATES[1]) + lynx_pair("lynx-linear", get_scheme("linear"))
    codecs += lynx_pair("lynx-1.3", default.replace(extremes="midpoint"))  # the earlier default: extremes at the midpoints
    default_1_2 = default.replace(alpha=1.0, key_rotation="none", extremes="midpoint")  # the earlier default before the key rotation
    codecs += lynx_pair("lynx-1.2", default_1_2)
    codecs += lynx_pair("lynx-alpha1-1.0", default_1_2.replace(value_axis="token", sink_tokens=0))  # the 1.0 default
    codecs += lynx_pair("lynx-paper", get_scheme("paper"))
    for a in (3, 5, 6):
        codecs += lynx_pair(f"lynx-{a}+{8 - a}", default.replace(anchor_bits=a, residual_bits=8 - a))
    return codecs


def registry() -> dict[str, object]:
    """Every named codec of a standard ``lynxkv eval`` run, in table order."""
    return {c.name: c for c in _baselines() + _lynx_codecs()}


def chosen_codecs() -> dict[str, object]:
    """The scheme chosen per cache, full code and anchor: named with ``--schemes`` only, since they need a model
    (:class:`ChosenLynx`)."""
    return {c.name: c for c in (ChosenLynx("lynx-chosen"), ChosenLynx("lynx-chosen-anchor", True))}


def sweep_codecs() -> dict[str, object]:
    """The ablation, one factor at a time around the default scheme (full and anchor for each variant):
    compander (linear, α ∈ {0.25, 0.5 (the default), 1, 2, 10, 100, 255}), the keys not rotated (``keys=none``;
    the default's are: ``keys=hadamard``), also at α = 1, the full code's end sub-bins at their midpoints
    (``extremes=midpoint``, the earlier default; the default's: ``range``), centring (midrange, mean),
    values per token instead of per channel, sink tokens ∈ {0, 1, 16} (default 4), chunk C ∈ {16, 32, 64}, page
    P ∈ {128, 256, 512} and split ∈ {3+5, 4+4, 5+3, 6+2}."""
    base = get_scheme("default")
    variants: list[tuple[str, Scheme]] = [("default", base), ("linear", base.replace(compander="linear", alpha=0.0))]
    variants += [("values=token", base.replace(value_axis="token"))]
    variants += [(f"sinks={n}", base.replace(sink_tokens=n)) for n in (0, 1, 16)]
    variants += [(f"alpha={a:g}", base.replace(compander="alpha", alpha=float(a))) for a in (0.25, 1, 2, 10, 100, 255)]
    variants += [("keys=none", base.replace(key_rotation="none")),
                 ("keys=none,alpha=1", base.replace(key_rotation="none", alpha=1.0))]
    variants += [("extremes=midpoint", base.replace(extremes="midpoint"))]
    variants += [("centring=mean", base.replace(centring="mean"))]
    variants += [(f"C={c}", base.replace(chunk=c)) for c in (16, 64)]
    variants += [(f"P={p}", base.replace(page=p)) for p in (128, 512)]
    variants += [(f"split={a}+{8 - a}", base.replace(anchor_bits=a, residual_bits=8 - a)) for a in (3, 5, 6)]
    codecs: list = [Identity()]
    for name, scheme in variants:
        codecs += lynx_pair(name, scheme)
    return {c.name: c for c in codecs}


def select(names: str | None, *, sweep: bool = False) -> list:
    """The codecs named in a comma-separated list (``None``: all), in registry order for ``None``."""
    pool: dict[str, object] = sweep_codecs() if sweep else registry()
    if not names:
        return list(pool.values())
    everything = {**registry(), **chosen_codecs(), **sweep_codecs()}
    chosen = []
    for raw in names.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in everything:
            raise InputError(f"--schemes: unknown codec {name!r}; known: {', '.join(everything)}")
        chosen.append(everything[name])
    if not chosen:
        raise InputError("--schemes: no codec named")
    return chosen


