"""Exact records: the bytes of one (layer, page) of the exact segment, and their application.

Exact record for a page of n tokens, ``E`` bytes per element of the original dtype, little-endian, no padding:

    CRC-32 of the page's original bytes (K [H, n, D] then V [H, n, D], row-major, little-endian) |
    byte planes of the remainder of K then V (2·H·n·D elements, in the prediction's exponent order):
    plane 0 (byte 0 of every element) ... plane E-1

The remainder is :func:`lynxkv.quant.remainder.remainder_planes` against the full code decoded to the original
dtype (spec §9.3). Applying a record rebuilds the original page and checks it against the CRC before anything
is returned, so a record of another cache, a corrupt one or a prediction that differs from the writer's is refused.
Records are stored raw (codec 0) or as zstd frames split at the exponent runs (codec 2), whichever is smaller.
"""

from __future__ import annotations

import struct
import warnings

import numpy as np
import torch

from lynxkv.errors import ChecksumError, FormatError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.records import dequantize_records
from lynxkv.quant.remainder import apply_planes, element_bytes, remainder_planes_and_runs

#: zstd level of the exact pages: level 1 was as small as level 3 and faster on KV (docs/format.md, "Exact tier")
EXACT_ZSTD_LEVEL = 1
#: the shortest run of one exponent value in plane 0 that gets a zstd frame of its own (shorter ones join the next)
EXACT_MIN_RUN = 1024


def encode_exact_layer(original: tuple[torch.Tensor, torch.Tensor], predicted: tuple[torch.Tensor, torch.Tensor],
                       page: int, tokens: int):
    """The exact record of each page of one layer, in page order, with where its zstd frames split: ``original``
    and ``predicted`` are the layer's (keys, values) ``[H, T, D]`` in the original dtype, ``predicted`` the full
    code's decoding."""
    (k, v), (pk, pv) = original, predicted

    def record(p: int):
        sl = slice(p * page, min((p + 1) * page, tokens))
        both = joined(k[:, sl], v[:, sl])  # K then V of the page, one contiguous copy
        pred = joined(pk[:, sl], pv[:, sl])
        head = struct.pack("<I", crc32(both.view(torch.uint8).numpy()))
        planes, runs = remainder_planes_and_runs(both, pred)
        return head + planes.numpy().tobytes(), frame_splits(runs, both.numel(), planes.shape[0])

    yield from map(record, range(-(-tokens // page)))


def predict_layer(records, scheme, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype, *,
                  first: int = 0):
    """The prediction of one layer -- its full code decoded to ``dtype``, ``([H, T, D], [H, T, D])`` -- from the
    ``(anchor, residual)`` page records the writer produced for it, through the reader's own decoding
    (:func:`lynxkv.format.records.dequantize_records`: the packed codes read in place). ``first``: the records are
    those of the ``tokens`` tokens from the layer's token ``first`` (a page boundary) on, not of the whole layer."""
    anchor, anchor_at = _joined([a for a, _ in records])
    residual, residual_at = _joined([r for _, r in records])
    page = scheme.page
    spans = [(p * page, min(page, tokens - p * page)) for p in range(len(records))]
    out = tuple(torch.empty(kv_heads, tokens, head_dim, dtype=dtype) for _ in range(2))
    dequantize_records(anchor, anchor_at, residual, residual_at, spans, scheme, kv_heads, head_dim, out,
                       lambda p: f"layer page {first // page + p}", first=first)
    return out


def _joined(parts) -> tuple[bytes, list[int]]:
    at, run = [], 0
    for part in parts:
        at.append(run)
        run += len(part)
    return b"".join(parts), at


def joined(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K then V of a page (CPU tensors of one dtype, any strides) as one contiguous 1-d tensor. The copy is
    numpy's, on the calling thread: a torch copy splits itself over torch's intra-op threads, which beside the
    writer's and reader's own workers on a small machine made each page's copy tens of times slower."""
    return torch.from_numpy(np.concatenate((_ints(k), _ints(v))).reshape(-1)).view(k.dtype)


def _ints(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s bits (integers of its width; numpy has no bf16), writable, same strides."""
    return t.view(_INT_VIEWS[t.dtype]).numpy()


_INT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def frame_splits(groups: list[int], n: int, planes: int, min_run: int = EXACT_MIN_RUN) -> list[int]:
    """Where the writer starts a new zstd frame in an exact record (codec 2): in plane 0 at the start of each
    run of one exponent value (runs shorter than ``min_run`` elements join the next one), then at each further
    plane. Any splits give a valid file; these make each frame's statistics uniform."""
    splits, at, run = [], c.EXACT_RECORD_CRC_SIZE, 0
    for g in groups[:-1]:
        at += g
        run += g
        if run >= min_run:
            splits.append(at)
            run = 0
    return splits + [c.EXACT_RECORD_CRC_SIZE + j * n for j in range(1, planes)]


def apply_exact_record(raw, predicted_k: torch.Tensor, predicted_v: torch.Tensor, where: str,
                       out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """Rebuild the original keys and values of one page from its raw exact record and the page's prediction
    (``[H, n, D]`` each, the original dtype) into ``out_k`` / ``out_v``; the original bytes' CRC is checked before
    anything is written."""
    e = element_bytes(predicted_k.dtype)
    n = predicted_k.numel()
    want = c.EXACT_RECORD_CRC_SIZE + 2 * n * e
    if len(raw) != want:
        raise FormatError(f"`page.raw_length` {where}: expected {want} bytes, got {len(raw)}",
                          field="page.raw_length", where=where)
    stored_crc = struct.unpack_from("<I", raw, 0)[0]
    predicted = joined(predicted_k, predicted_v)
    with warnings.catch_warnings():  # the record is only read: a view of the (read-only) page bytes, no copy
        warnings.simplefilter("ignore", UserWarning)
        planes = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8,
                                                offset=c.EXACT_RECORD_CRC_SIZE).reshape(e, 2 * n))
    both = apply_planes(planes, predicted)
    got = crc32(both.view(torch.uint8).numpy())
    if got != stored_crc:
        raise ChecksumError(f"`exact.original_crc32` {where}: expected {stored_crc:#010x}, got {got:#010x} (the exact "
                            "record does not rebuild this cache's original values: corrupt, of another cache, or "
                            "decoded from a different full code)", field="exact.original_crc32", where=where)
    _ints(out_k)[...] = _ints(both[:n]).reshape(out_k.shape)
    _ints(out_v)[...] = _ints(both[n:]).reshape(out_v.shape)
