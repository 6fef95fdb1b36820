"""KV caches as safetensors files: reading the accepted naming conventions, writing them back.

A KV dump holds, for every layer i, a key and a value tensor shaped ``[kv_heads, tokens, head_dim]`` or
``[1, kv_heads, tokens, head_dim]``, in fp32, fp16 or bf16, under one of these name styles:

=================  =============================================
style              names
=================  =============================================
``layers``         ``layers.{i}.key``, ``layers.{i}.value`` (canonical)
``past_key_values`` ``past_key_values.{i}.key``, ``past_key_values.{i}.value``
=================  =============================================

Layers are numbered from 0 without gaps; all tensors share one dtype and one shape. ``lynxkv decode`` writes the
same names and shapes that went in.

A dump holds one sequence: a batch larger than 1 is refused (split it and encode one cache per sequence). A
3-d tensor with more entries on its first axis than on its second looks token-major (``[tokens, kv_heads,
head_dim]``) and is refused as ambiguous, unless the file's metadata says ``"lynxkv.layout":
"kv_heads,tokens,head_dim"`` (a cache really shorter than its number of KV heads).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from lynxkv.cache.kv import DTYPE_NAMES, KVPairs
from lynxkv.errors import InputError


NAME_STYLES = ("layers", "past_key_values")
_NAME = re.compile(rf"^({'|'.join(NAME_STYLES)})\.(\d+)\.(key|value)$")
MAX_LAYERS = 4096
LAYOUT_KEY, HEADS_MAJOR = "lynxkv.layout", "kv_heads,tokens,head_dim"


@dataclass(frozen=True)
class KVNaming:
    """How a KV dump named and shaped its tensors, so that decoding can write them back the same way."""

    style: str = "layers"
    batched: bool = False  # tensors had a leading batch dimension of 1
    metadata: tuple[tuple[str, str], ...] = ()  # the file's safetensors __metadata__, kept through encode/decode

    def name(self, layer: int, kind: str) -> str:
        return f"{self.style}.{layer}.{kind}"


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InputError(f"unsupported dtype {dtype}; expected one of fp32, fp16, bf16") from None


def load_kv_safetensors(path: str | os.PathLike) -> tuple[KVPairs, KVNaming]:
    """Read a KV dump; return per-layer ``(keys, values)`` ``[H, T, D]`` and its naming."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            metadata = f.metadata() or {}
            heads_major = metadata.get(LAYOUT_KEY) == HEADS_MAJOR
            found: dict[tuple[int, str], str] = {}
            styles = set()
            for name in names:
                m = _NAME.match(name)
                if not m:
                    raise InputError(
                        f"{path}: tensor {name!r} does not follow a KV naming style "
                        f"(expected 'layers.{{i}}.key' / 'layers.{{i}}.value' or 'past_key_values.{{i}}.key' ...)"
                    )
                styles.add(m.group(1))
                found[(int(m.group(2)), m.group(3))] = name
            if not found:
                raise InputError(f"{path}: holds no tensors")
            if len(styles) > 1:
                raise InputError(f"{path}: mixes naming styles {sorted(styles)}")
            layers = 1 + max(i for i, _ in found)
            if layers > MAX_LAYERS:
                raise InputError(f"{path}: layer index {layers - 1} exceeds the limit of {MAX_LAYERS - 1}")
            for i in range(layers):
                for kind in ("key", "value"):
                    if (i, kind) not in found:
                        raise InputError(f"{path}: missing tensor for layer {i} {kind}")
            kv: KVPairs = []
            shapes = set()
            dtypes = set()
            batched = None
            for i in range(layers):
                pair = []
                for kind in ("key", "value"):
                    t = f.get_tensor(found[(i, kind)])
                    if t.dim() == 4 and t.shape[0] != 1:
                        raise InputError(
                            f"{path}: {found[(i, kind)]} has shape {tuple(t.shape)}, a batch of {t.shape[0]} "
                            "sequences; a cache holds one sequence: split the batch and encode each on its own")
                    if t.dim() == 4:
                        this_batched, t = True, t[0]
                    elif t.dim() == 3:
                        this_batched = False
                    else:
                        raise InputError(
                            f"{path}: {found[(i, kind)]} has shape {tuple(t.shape)}; expected "
                            "[kv_heads, tokens, head_dim] or [1, kv_heads, tokens, head_dim]"
                        )
                    if t.shape[0] > t.shape[1] and not heads_major:
                        raise InputError(
                            f"{path}: {found[(i, kind)]} has shape {tuple(t.shape)}: {t.shape[0]} KV heads but "
                            f"only {t.shape[1]} tokens, which looks token-major [tokens, kv_heads, head_dim]; "
                            "lynxkv expects [kv_heads, tokens, head_dim] (transpose the first two axes), or set "
                            f"the file's metadata {LAYOUT_KEY}={HEADS_MAJOR} if the shape is right")
                    if batched is not None and batched != this_batched:
                        raise InputError(f"{path}: some tensors have a batch dimension and some do not")
                    batched = this_batched
                    dtype_name(t.dtype)
                    shapes.add(tuple(t.shape))
                    dtypes.add(t.dtype)
                    pair.append(t)
                kv.append((pair[0], pair[1]))
    except SafetensorError as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc})") from None
    if len(shapes) != 1:
        raise InputError(f"{path}: tensors differ in shape: {sorted(shapes)}")
    if len(dtypes) != 1:
        raise InputError(f"{path}: tensors differ in dtype: {sorted(map(str, dtypes))}")
    return kv, KVNaming(styles.pop(), bool(batched), tuple(sorted(metadata.items())))


def kv_names(layers: int, naming: KVNaming = KVNaming()) -> list[str]:
    """Tensor names in file order: layer 0 key, layer 0 value, layer 1 key, ..."""
    return [naming.name(i, kind) for i in range(layers) for kind in ("key", "value")]


def save_kv_safetensors(
    path: str | os.PathLike,
    kv: KVPairs,
    names: list[str] | tuple[str, ...] | None = None,
    *,
    batched: bool = False,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write per-layer ``(keys, values)`` under ``names`` (default: the ``layers`` style) atomically."""
    from safetensors.torch import save_file

    from lynxkv.storage import atomic_path

    names = list(names) if names else kv_names(len(kv))
    if len(names) != 2 * len(kv):
        raise InputError(f"expected {2 * len(kv)} tensor names for {len(kv)} layers, got {len(names)}")
    tensors = {}
    for i, (k, v) in enumerate(kv):
        for j, t in enumerate((k, v)):
            tensors[names[2 * i + j]] = (t.unsqueeze(0) if batched else t).contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)
