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

Neither direction needs the whole file in memory: :func:`open_dump` checks a dump's header and its
:meth:`KVDump.iter_layers` reads one layer at a time; :func:`write_kv_safetensors` writes the header (computable
from the shape, dtype and names) and then each tensor as it comes, in layer order, published atomically.

A dump holds one sequence: a batch larger than 1 is refused (split it and encode one cache per sequence). A
3-d tensor with more entries on its first axis than on its second looks token-major (``[tokens, kv_heads,
head_dim]``) and is refused as ambiguous, unless the file's metadata says ``"lynxkv.layout":
"kv_heads,tokens,head_dim"`` (a cache really shorter than its number of KV heads).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
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


#: safetensors' names of the dtypes a cache stores (little-endian, as the format is).
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class KVDump:
    """A KV dump whose header has been read and checked (:func:`open_dump`): names, shape and dtype are known
    before any tensor is read; :meth:`iter_layers` then reads one layer at a time."""

    path: str
    naming: KVNaming
    layers: int
    shape: tuple[int, int, int]  # [kv_heads, tokens, head_dim] of every tensor, without the batch dimension
    dtype: torch.dtype
    tensor_names: tuple[str, ...]  # K0, V0, K1, V1, ... as the file names them
    spans: tuple[tuple[int, int], ...] = ()  # each tensor's bytes in the file, in tensor_names' order

    def iter_layers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(keys, values)`` ``[H, T, D]``, read from the file when asked for (positional reads, no
        mapping of the file): a caller that lets each layer go holds one layer, not the dump."""
        with open(self.path, "rb") as f:
            for i in range(self.layers):
                yield tuple(self._read(f.fileno(), 2 * i + j) for j in range(2))

    def iter_pieces(self, tokens: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """``(layer, start, keys, values)`` of each layer in pieces of ``tokens`` tokens (the last piece of a layer
        holds the rest), in layer order: keys and values ``[H, n, D]`` of the tokens ``[start, start + n)``, read
        from the file when asked for, so that a caller that lets each piece go holds one piece, not a layer."""
        if tokens < 1:
            raise InputError(f"tokens: expected a piece of at least one token, got {tokens}")
        with open(self.path, "rb") as f:
            for i in range(self.layers):
                for start in range(0, max(self.shape[1], 1), tokens):
                    stop = min(start + tokens, self.shape[1])
                    yield (i, start, *(self._read(f.fileno(), 2 * i + j, start, stop) for j in range(2)))

    def _read(self, fd: int, k: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``k`` (in ``tensor_names``' order), or its tokens ``[start, stop)``: ``[H, n, D]``, one positional
        read per head (one for them all when the range is every token)."""
        h, t, d = self.shape
        stop = t if stop is None else stop
        item = self.dtype.itemsize
        row, run = t * d * item, (stop - start) * d * item  # one head's bytes in the file; the range's bytes of it
        first = self.spans[k][0] + start * d * item
        reads = [(first, h * run)] if run == row else [(first + j * row, run) for j in range(h)]
        buf = bytearray(h * run)
        view = memoryview(buf)
        for j, (at, size) in enumerate(reads):
            got, part = 0, view[j * size:(j + 1) * size]
            while got < size:
                n = os.preadv(fd, [part[got:]], at + got)
                if n == 0:
                    raise InputError(f"{self.path}: ends inside {self.tensor_names[k]} (the file is truncated)")
                got += n
        x = torch.frombuffer(buf, dtype=self.dtype) if buf else torch.empty(0, dtype=self.dtype)
        return x.view(h, stop - start, d)


_MAX_HEADER = 100 << 20  # a safetensors header larger than this is refused before it is read


def read_safetensors_header(path: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """The ``__metadata__`` and, per tensor, ``(dtype, shape, start, end)`` (file offsets) of a safetensors file,
    every field checked against the file's size: a header claims, it does not instruct."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: not a readable safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise InputError(f"{path}: not a readable safetensors file (a header of {n} bytes in a file of {size})")
        try:
            doc = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not a readable safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: not a readable safetensors file (its header is not an object)")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: not a readable safetensors file (__metadata__ is not text)")
    tensors, base = {}, 8 + n
    for name, e in doc.items():
        ok = (isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in e["shape"]) and isinstance(e.get("data_offsets"), list)
              and len(e["data_offsets"]) == 2 and all(isinstance(o, int) for o in e["data_offsets"]))
        if not ok:
            raise InputError(f"{path}: not a readable safetensors file (tensor {name[:80]!r} is malformed)")
        a, b = e["data_offsets"]
        if not 0 <= a <= b <= size - base:
            raise InputError(f"{path}: not a readable safetensors file ({name[:80]!r} lies outside the file)")
        dtype = SAFETENSORS_DTYPES.get(e["dtype"])
        if dtype is not None and b - a != math.prod(e["shape"]) * dtype.itemsize:
            raise InputError(f"{path}: not a readable safetensors file ({name[:80]!r}: {b - a} bytes for shape "
                             f"{e['shape']} {e['dtype']})")
        tensors[name] = (e["dtype"], tuple(e["shape"]), base + a, base + b)
    return metadata, tensors


def open_dump(path: str | os.PathLike) -> KVDump:
    """Read and check a KV dump's header (names, shapes, dtypes; the module's rules) without reading a tensor."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    metadata, entries = read_safetensors_header(path)
    found, style = _tensor_names(path, list(entries))
    layers = 1 + max(i for i, _ in found)
    names = tuple(found[(i, kind)] for i in range(layers) for kind in ("key", "value"))
    shapes = [(name, entries[name][1], entries[name][0]) for name in names]
    heads_major = metadata.get(LAYOUT_KEY) == HEADS_MAJOR
    seen_shapes, seen_dtypes, batched = set(), set(), None
    for name, shape, dtype in shapes:
        this_batched, shape = _check_shape(path, name, tuple(shape), heads_major)
        if batched is not None and batched != this_batched:
            raise InputError(f"{path}: some tensors have a batch dimension and some do not")
        batched = this_batched
        if dtype not in SAFETENSORS_DTYPES:
            raise InputError(f"{path}: {name} has dtype {dtype}; expected one of fp32, fp16, bf16 "
                             f"({', '.join(SAFETENSORS_DTYPES)})")
        seen_shapes.add(shape)
        seen_dtypes.add(dtype)
    if len(seen_shapes) != 1:
        raise InputError(f"{path}: tensors differ in shape: {sorted(seen_shapes)}")
    if len(seen_dtypes) != 1:
        raise InputError(f"{path}: tensors differ in dtype: {sorted(seen_dtypes)}")
    naming = KVNaming(style, bool(batched), tuple(sorted(metadata.items())))
    return KVDump(path, naming, layers, seen_shapes.pop(), SAFETENSORS_DTYPES[seen_dtypes.pop()], names,
                  tuple(entries[name][2:] for name in names))


def _tensor_names(path: str, names: list[str]) -> tuple[dict[tuple[int, str], str], str]:
    """``(layer, "key" | "value") -> name`` of every tensor, checked against the naming styles; and the style."""
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
    return found, styles.pop()


def _check_shape(path: str, name: str, shape: tuple, heads_major: bool) -> tuple[bool, tuple]:
    """(batched, ``[H, T, D]``) of one tensor's declared shape, or the error that refuses it."""
    if len(shape) == 4 and shape[0] != 1:
        raise InputError(
            f"{path}: {name} has shape {shape}, a batch of {shape[0]} sequences; a cache holds one sequence: "
            "split the batch and encode each on its own")
    if len(shape) not in (3, 4):
        raise InputError(f"{path}: {name} has shape {shape}; expected [kv_heads, tokens, head_dim] or "
                         "[1, kv_heads, tokens, head_dim]")
    batched, shape = len(shape) == 4, shape[-3:]
    if shape[0] > shape[1] and not heads_major:
        raise InputError(
            f"{path}: {name} has shape {shape}: {shape[0]} KV heads but only {shape[1]} tokens, which looks "
            "token-major [tokens, kv_heads, head_dim]; lynxkv expects [kv_heads, tokens, head_dim] (transpose "
            f"the first two axes), or set the file's metadata {LAYOUT_KEY}={HEADS_MAJOR} if the shape is right")
    return batched, shape


def load_kv_safetensors(path: str | os.PathLike) -> tuple[KVPairs, KVNaming]:
    """Read a KV dump; return per-layer ``(keys, values)`` ``[H, T, D]`` and its naming."""
    dump = open_dump(path)
    return list(dump.iter_layers()), dump.naming


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
    """Write per-layer ``(keys, values)`` under ``names`` (default: the ``layers`` style) atomically: the bytes
    :func:`write_kv_safetensors` writes for the same layers."""
    if not kv:
        raise InputError("kv: expected at least one layer")
    k0 = kv[0][0]
    write_kv_safetensors(path, kv, layers=len(kv), shape=tuple(k0.shape), dtype=k0.dtype, names=names,
                         batched=batched, metadata=metadata)


def safetensors_header(names: Sequence[str], shape: Sequence[int], dtype: torch.dtype,
                       metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file before its data, for tensors ``names`` of one ``shape`` and ``dtype``
    stored one after the other in that order: the 8-byte little-endian header length, then the JSON header
    (``__metadata__`` first, keys sorted; compact) padded with spaces to a multiple of 8, as safetensors pads it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    for i, name in enumerate(names):
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [i * nbytes, (i + 1) * nbytes]}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_kv_safetensors(path: str | os.PathLike, kv: Iterable[tuple[torch.Tensor, torch.Tensor]], *, layers: int,
                         shape: Sequence[int], dtype: torch.dtype, names: Sequence[str] | None = None,
                         batched: bool = False, metadata: dict[str, str] | None = None) -> None:
    """Write ``layers`` layers of ``(keys, values)`` ``[H, T, D]`` (``shape``, ``dtype``) as a safetensors file,
    tensor by tensor as ``kv`` yields them: the header is known from the shape up front, so a caller that
    produces one layer at a time holds one layer, not the file. Published atomically
    (:class:`lynxkv.storage.AtomicWriter`): an error (a layer missing or of another shape, a full disk) leaves
    nothing under ``path``."""
    from lynxkv.storage import AtomicWriter

    shape = tuple(int(n) for n in shape)
    names = list(names) if names else kv_names(layers)
    if len(names) != 2 * layers:
        raise InputError(f"expected {2 * layers} tensor names for {layers} layers, got {len(names)}")
    dtype_name(dtype)
    with AtomicWriter(path) as out:
        out.write(safetensors_header(names, ((1,) if batched else ()) + shape, dtype, metadata))
        done = 0
        for pair in kv:
            if done == layers:
                raise InputError(f"expected {layers} layers, got more")
            for t in pair:
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise InputError(f"layer {done}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
                # the tensor's bytes as they lie in memory (safetensors is little-endian, as are lynxkv's hosts)
                out.write(t.detach().to("cpu").contiguous().view(torch.uint8).numpy())
            done += 1
        if done != layers:
            raise InputError(f"expected {layers} layers, got {done}")
