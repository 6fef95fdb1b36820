"""Quantization schemes: the small, frozen, validated parameter set written into every ``.lynx`` header.

A scheme fixes everything the decoder needs to turn codes back into values (spec/FORMAT.md, "Quantizer"):

- ``compander``: ``linear`` or ``alpha`` (Lynx's α-law, ``sign(u)·ln(1+α|u|)/ln(1+α)``) and its ``alpha``;
- ``centring``: ``midrange`` (chunk (max+min)/2) or ``mean`` (chunk mean, Lynx's Algorithm 1);
- ``chunk`` C: tokens that share one (offset, scale) pair per channel; ``page`` P: tokens per stored page;
- ``anchor_bits`` / ``residual_bits``: the split of the 8-bit code (high bits = anchor, low bits = residual);
- ``grid``: ``nested`` (the anchor levels include the chunk's extremes, the residual places the value inside
  the anchor's cell) or ``uniform`` (a plain 255-step grid whose high bits are the anchor, decoded at the middle
  of its bin: Lynx's Algorithm 1);
- ``meta_dtype``: the storage dtype of the per-chunk offset and scale (``fp16`` or ``fp32``);
- ``value_axis``: how the values are grouped: ``token`` (chunks of C tokens per channel, like the keys) or
  ``channel`` (groups of C channels of one token: KIVI's value axis). Keys always run along tokens;
- ``sink_tokens`` S: the first S tokens of the cache are decoded from the full code also from the anchor alone
  (the anchor records of their pages carry their residual too: attention sinks);
- ``key_rotation``: ``none`` or ``hadamard``: the keys are rotated along head_dim by an orthonormal
  Walsh–Hadamard matrix before they are quantized and rotated back after decoding
  (:mod:`lynxkv.quant.rotation`). Values are not rotated;
- ``extremes``: where the full code of the nested grid decodes the two end sub-bins that hold the chunk's extremes
  (the codes ``(0, R/2)``, ``(A, R/2 - 1)`` and ``(A, R/2)``): ``midpoint`` (the centre of the sub-bin, like every
  other code) or ``range`` (the chunk's range ends ``o ∓ s``, where its min and max
  lie up to the metadata's rounding; the midpoints sit 1/(2R) of an anchor step inside them, so every chunk's
  extremes were pulled towards its centre).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lynxkv.errors import SchemeError

COMPANDERS = ("linear", "alpha")
CENTRINGS = ("midrange", "mean")
META_DTYPES = ("fp16", "fp32")
GRIDS = ("nested", "uniform")
VALUE_AXES = ("token", "channel")
KEY_ROTATIONS = ("none", "hadamard")  # 1.3: hadamard is lynxkv.quant.rotation
EXTREMES = ("midpoint", "range")  # 1.6: range decodes the end sub-bins of the nested grid at the chunk's extremes
CODE_BITS = 8

MAX_CHUNK = 1024
MAX_PAGE = 65536
MAX_SINK_TOKENS = 65536
MAX_ALPHA = 65504.0
#: Below this the α-law is the linear code to within fp32 rounding of ``log1p(α|u|)/log1p(α)`` (and a subnormal
#: α underflows ``α|u|`` to 0, mapping every value to the chunk centre): use the linear compander instead.
MIN_ALPHA = 1e-3


@dataclass(frozen=True)
class Scheme:
    compander: str = "linear"
    alpha: float = 0.0
    centring: str = "midrange"
    chunk: int = 32
    page: int = 256
    anchor_bits: int = 4
    residual_bits: int = 4
    meta_dtype: str = "fp16"
    grid: str = "nested"
    value_axis: str = "token"
    sink_tokens: int = 0
    key_rotation: str = "none"
    extremes: str = "midpoint"

    def __post_init__(self) -> None:
        if self.compander not in COMPANDERS:
            raise SchemeError(f"compander: expected one of {COMPANDERS}, got {self.compander!r}")
        if self.centring not in CENTRINGS:
            raise SchemeError(f"centring: expected one of {CENTRINGS}, got {self.centring!r}")
        if self.grid not in GRIDS:
            raise SchemeError(f"grid: expected one of {GRIDS}, got {self.grid!r}")
        if self.value_axis not in VALUE_AXES:
            raise SchemeError(f"value_axis: expected one of {VALUE_AXES}, got {self.value_axis!r}")
        if self.key_rotation not in KEY_ROTATIONS:
            raise SchemeError(f"key_rotation: expected one of {KEY_ROTATIONS}, got {self.key_rotation!r}")
        if self.extremes not in EXTREMES:
            raise SchemeError(f"extremes: expected one of {EXTREMES}, got {self.extremes!r}")
        if self.extremes == "range" and self.grid != "nested":
            raise SchemeError("extremes: 'range' applies to the nested grid only (the uniform grid's end codes "
                              "already decode at the chunk's extremes)")
        if self.meta_dtype not in META_DTYPES:
            raise SchemeError(f"meta_dtype: expected one of {META_DTYPES}, got {self.meta_dtype!r}")
        if self.compander == "alpha":
            if not (math.isfinite(self.alpha) and MIN_ALPHA <= self.alpha <= MAX_ALPHA):
                raise SchemeError(f"alpha: expected {MIN_ALPHA:g} <= alpha <= {MAX_ALPHA:g} for the alpha compander "
                                  f"(for a smaller alpha use the linear compander), got {self.alpha:g}")
        elif self.alpha != 0.0:
            raise SchemeError(f"alpha: must be 0 for the linear compander, got {self.alpha}")
        if not _is_pow2(self.chunk) or not 1 <= self.chunk <= MAX_CHUNK:
            raise SchemeError(f"chunk: expected a power of two in [1, {MAX_CHUNK}], got {self.chunk}")
        if not 1 <= self.page <= MAX_PAGE or self.page % self.chunk:
            raise SchemeError(f"page: expected a multiple of chunk={self.chunk} in [1, {MAX_PAGE}], got {self.page}")
        if not (1 <= self.anchor_bits <= 7 and 1 <= self.residual_bits <= 7):
            raise SchemeError(
                f"anchor_bits/residual_bits: expected each in [1, 7], got {self.anchor_bits}+{self.residual_bits}"
            )
        if self.anchor_bits + self.residual_bits != CODE_BITS:
            raise SchemeError(
                f"anchor_bits + residual_bits: expected {CODE_BITS}, got {self.anchor_bits}+{self.residual_bits}"
            )
        if not (isinstance(self.sink_tokens, int) and 0 <= self.sink_tokens <= MAX_SINK_TOKENS):
            raise SchemeError(f"sink_tokens: expected 0 <= sink_tokens <= {MAX_SINK_TOKENS}, got {self.sink_tokens}")

    def axis(self, kind: str) -> str:
        """The axis the groups of ``kind`` (``"key"`` or ``"value"``) run along: ``token`` or ``channel``."""
        return self.value_axis if kind == "value" else "token"

    def rotated(self, kind: str) -> bool:
        """Whether ``kind`` (``"key"`` or ``"value"``) is rotated before it is quantized (the keys, with
        ``key_rotation = "hadamard"``)."""
        return kind == "key" and self.key_rotation == "hadamard"

    # Derived constants of the code (spec/FORMAT.md, "Quantizer"). -----------------------------------------
    @property
    def anchor_steps(self) -> int:
        """A: the anchor grid has A+1 levels, the first and last at the chunk's extremes."""
        return (1 << self.anchor_bits) - 1

    @property
    def residual_levels(self) -> int:
        """R: residual sub-levels inside one anchor step."""
        return 1 << self.residual_bits

    @property
    def code_steps(self) -> int:
        """Q = 255: steps of the uniform grid over [-1, 1]."""
        return (1 << CODE_BITS) - 1

    @property
    def meta_bytes(self) -> int:
        return 2 if self.meta_dtype == "fp16" else 4

    def bits_per_element(self, *, anchor_only: bool = False, tokens: int | None = None,
                         head_dim: int | None = None) -> float:
        """Payload plus metadata bits per element, keys and values averaged: chunk padding of a short tail
        (``tokens``) and of a head_dim that is not a multiple of C (``head_dim``, for values per channel)
        included when given, and the sink tokens' residual that the anchor carries (with ``tokens``; both
        files together hold it twice)."""
        meta = 2 * self.meta_bytes * 8

        def per_group(n: int | None) -> float:
            return meta / self.chunk if n is None else meta * math.ceil(n / self.chunk) / max(n, 1)

        value_meta = per_group(head_dim if self.value_axis == "channel" else tokens)
        sinks = 0.0 if tokens is None else self.residual_bits * min(self.sink_tokens, tokens) / max(tokens, 1)
        return (self.anchor_bits if anchor_only else CODE_BITS) + (per_group(tokens) + value_meta) / 2 + sinks

    def replace(self, **changes) -> "Scheme":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        comp = "linear" if self.compander == "linear" else f"alpha={self.alpha:g}"
        grid = "" if self.grid == "nested" else f", {self.grid} grid"
        values = "" if self.value_axis == "token" else f", V per {self.value_axis}"
        sinks = f", {self.sink_tokens} sink tokens" if self.sink_tokens else ""
        rotation = f", K {self.key_rotation}-rotated" if self.rotated("key") else ""
        extremes = ", extremes at the range" if self.extremes == "range" else ""
        return (
            f"{comp}, {self.centring}{grid}, C={self.chunk}, P={self.page}, "
            f"{self.anchor_bits}+{self.residual_bits}, meta {self.meta_dtype}{values}{sinks}{rotation}{extremes}"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


#: A linear 8-bit code over the chunk's mid-range whose 4 high bits are the nearest level of a min/max-inclusive
#: 4-bit grid: exactly rounded IEEE arithmetic only, so every implementation (reference, fast CPU path, Triton)
#: gives the same codes on every device, and the fastest encode.
LINEAR = Scheme()

#: The default: the same grid with a mild α-law compander (α = 0.5), the keys rotated by a per-head Walsh–Hadamard
#: matrix along head_dim before they are quantized, the values grouped per token over channels (KIVI's axis) and
#: the first 4 tokens (attention sinks) decoded from the full code also from the anchor alone; chosen by measured
#: anchor-only draft quality at 5 bits on the built-in prompts (README, "Choosing the default scheme").
#: Format 1.6 added the full code's end sub-bins decoded at the chunk's extremes (next-token KL of the full code
#: 3.4 times lower on the built-in text; docs/evaluation.md, "Why the full code lowered perplexity").
DEFAULT = LINEAR.replace(compander="alpha", alpha=0.5, value_axis="channel", sink_tokens=4, key_rotation="hadamard",
                         extremes="range")

#: The default's second candidate where a model chooses the scheme per cache (:mod:`lynxkv.hf.choose`): the default
#: with its keys quantized as they are (no rotation), which drafts better on models where the rotation spreads the
#: keys' error into the channels their queries weigh (Gemma 3: docs/evaluation.md, "The anchor chosen per cache").
PLAIN_KEYS = DEFAULT.replace(key_rotation="none")

#: Lynx's Algorithm 1 as published: α-law (α=100) around the chunk mean, scaled by the max-abs deviation, on a
#: uniform 8-bit grid whose high nibble is the anchor.
PAPER = Scheme(compander="alpha", alpha=100.0, centring="mean", grid="uniform")

PRESETS: dict[str, Scheme] = {
    "default": DEFAULT,
    "plain-keys": PLAIN_KEYS,
    "linear": LINEAR,
    "paper": PAPER,
    "paper-a1": PAPER.replace(alpha=1.0),
}


def get_scheme(name: str = "default", **overrides) -> Scheme:
    """A preset by name, with optional field overrides (``None`` values are ignored)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise SchemeError(f"scheme: unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "alpha" in changes and changes["alpha"] and "compander" not in changes:
        changes["compander"] = "alpha"
    if changes.get("compander") == "linear":
        changes["alpha"] = 0.0
    if "anchor_bits" in changes and "residual_bits" not in changes:
        changes["residual_bits"] = CODE_BITS - changes["anchor_bits"]
    return base.replace(**changes) if changes else base
