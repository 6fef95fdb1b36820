"""Page records decoded on the output's device: every device but the fast CPU path's (:mod:`lynxkv.quant.fast`).

The record bytes of a call go to ``out.device`` once (on a GPU what crosses the host link is the packed codes and
their metadata, never decoded KV), then each page is sliced out of that buffer and decoded there: the Triton
kernels for CUDA tensors (and for fp32/fp16 CPU tensors under ``TRITON_INTERPRET=1``), the torch reference
anywhere else (:func:`lynxkv.quant.dispatch.dequantize_packed`). Consecutive pages of one length whose records
are evenly spaced in the buffer (a layer's full pages) are gathered into one ``[P, ...]`` batch and decoded in one
launch (the kernels write straight into ``out``, the reference through a temporary), so a 32K-token layer costs a
few launches, not one per page. The metadata checks (finite offsets
and scales, scales >= 0) are collected on the device and read back once per call.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

from lynxkv.quant import fast, pack
from lynxkv.quant.reference import META_TORCH_DTYPE, EncodedTensor
from lynxkv.quant.scheme import Scheme


def device_bytes(buf, device: torch.device) -> torch.Tensor | None:
    """``buf`` (bytes, a memoryview, a mapping's view or a uint8 tensor) as a flat uint8 tensor on ``device``:
    one host-to-device copy; on the CPU a view of ``buf`` (read, never written)."""
    if buf is None:
        return None
    if isinstance(buf, torch.Tensor):
        t = buf.reshape(-1)
    elif len(buf) == 0:
        t = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only read
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(buf, dtype=torch.uint8)
    return t.to(device)


def _meta(buf: torch.Tensor, at: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The little-endian metadata array at byte ``at`` of ``buf``, viewed (aligned, on a device) or copied."""
    size = dtype.itemsize
    seg = buf[at:at + math.prod(shape) * size]
    if seg.device.type == "cpu" or at % size or sys.byteorder != "little":
        seg = seg.clone()  # an aligned, owned copy: a host buffer's own address may be unaligned
    if sys.byteorder != "little":
        seg = seg.view(-1, size).flip(1).reshape(-1)
    return seg.view(dtype).view(shape)


def _batched(buf: torch.Tensor, at: int, step: int, count: int, nbytes: int) -> torch.Tensor:
    """``count`` byte ranges of ``nbytes`` starting at ``at``, ``step`` apart, gathered into ``[count, nbytes]``."""
    return buf.as_strided((count, nbytes), (step, 1), buf.storage_offset() + at).contiguous()


def _runs(rows: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Split page rows into runs: consecutive pages of one token count, adjacent in ``out``, whose records are
    evenly spaced (a single page is a run of one; rows of eight, which decode part of what they hold, stay alone)."""
    runs: list[list[tuple[int, ...]]] = []
    for row in rows:
        cur = runs[-1] if runs else None
        if (cur is not None and len(row) == 6 and len(cur[0]) == 6 and row[5] == cur[0][5]
                and row[4] == cur[-1][4] + cur[-1][5]
                and (len(cur) == 1 or all(row[i] - cur[-1][i] == cur[1][i] - cur[0][i] for i in range(4)))):
            cur.append(row)
        else:
            runs.append([row])
    return runs


def dequantize_pages_on_device(anchor, residual, pages, scheme: Scheme, *, out: torch.Tensor, kind: str = "key",
                               entry) -> int:
    """:func:`lynxkv.quant.dispatch.dequantize_pages` on ``out``'s device (same rows, same flags). ``entry`` is
    the quantizer entry it decodes through (:mod:`lynxkv.quant.dispatch`, handed down: it imports this module)."""
    _triton, dequantize, dequantize_packed = entry._triton, entry.dequantize, entry.dequantize_packed

    h, _, d = out.shape
    axis, rotated = scheme.axis(kind), scheme.rotated(kind)
    c, mdt = scheme.chunk, META_TORCH_DTYPE[scheme.meta_dtype]
    abuf = device_bytes(anchor, out.device)
    rbuf = abuf if residual is anchor else device_bytes(residual, out.device)
    # CUDA tensors take the kernels; so do CPU tensors under Triton's interpreter, so that a machine without a GPU
    # runs the very launches (batched, into strided views of out) that a GPU makes -- but not into bf16, which the
    # interpreter rounds differently from the reference (it truncates)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and out.dtype != torch.bfloat16
    kernels = _triton() if out.is_cuda or interpreted else None
    direct = kernels is not None and kernels[1].supports(scheme) and fast.packable(scheme, d)
    problems: list[torch.Tensor] = []

    def meta_shape(held: int) -> tuple[int, int, int]:
        return (h, held, -(-d // c)) if axis == "channel" else (h, -(-held // c), d)

    def check(off: torch.Tensor, scale: torch.Tensor) -> None:
        problems.append(torch.stack([~torch.isfinite(off).all(), ~torch.isfinite(scale).all(), (scale < 0).any()]))

    def batch(run: list[tuple[int, ...]]) -> None:  # P whole pages at once: [P, H, n, D]
        (o_at, s_at, a_at, r_at, t0, n), p = run[0], len(run)
        mshape, steps = meta_shape(n), [run[1][i] - run[0][i] for i in range(4)]
        mbytes, cbytes = math.prod(mshape) * mdt.itemsize, h * n * d // 2
        off, sc = (_batched(abuf, at, st, p, mbytes).view(mdt).view(p, *mshape)
                   for at, st in ((o_at, steps[0]), (s_at, steps[1])))
        check(off, sc)
        a = _batched(abuf, a_at, steps[2], p, cbytes)
        r = None if rbuf is None else _batched(rbuf, r_at, steps[3], p, cbytes)
        target = out[:, t0:t0 + p * n].unflatten(1, (p, n)).transpose(0, 1)  # [P, H, n, D], a view of out
        if direct:
            kernels[1].decode(a, r, off, sc, scheme, target, kind=kind, rotated=rotated)
            return
        y = dequantize_packed(a.reshape(-1), None if r is None else r.reshape(-1), off.flatten(0, 1),
                              sc.flatten(0, 1), (p * h, n, d), scheme, kind=kind, dtype=out.dtype)
        target.copy_(y.view(p, h, n, d))

    def single(row: tuple[int, ...]) -> None:
        o_at, s_at, a_at, r_at, t0, n = row[:6]
        held, r_held = row[6:] if len(row) == 8 else (n, n)
        mshape, keep = meta_shape(held), n if axis == "channel" else -(-n // c)
        off, sc = (_meta(abuf, at, mshape, mdt)[:, :keep].contiguous() for at in (o_at, s_at))
        check(off, sc)
        target = out[:, t0:t0 + n]
        if held == r_held == n and fast.packable(scheme, d):
            nbytes = h * n * d // 2
            dequantize_packed(abuf[a_at:a_at + nbytes], None if rbuf is None else rbuf[r_at:r_at + nbytes], off,
                              sc, (h, n, d), scheme, kind=kind, out=target)
            return
        codes = [None if buf is None else
                 pack.unpack_bits(buf[at:at + pack.packed_size(h * rows * d, bits)], bits, h * rows * d)
                 .view(h, rows, d)[:, :n].contiguous()
                 for buf, at, bits, rows in ((abuf, a_at, scheme.anchor_bits, held),
                                             (rbuf, r_at, scheme.residual_bits, r_held))]
        dequantize(EncodedTensor(codes[0], codes[1], off, sc, axis, rotated=rotated), scheme,
                   anchor_only=rbuf is None, out=target)

    for run in _runs([tuple(int(v) for v in row) for row in pages]):
        if len(run) > 1 and fast.packable(scheme, d):
            batch(run)
        else:
            for row in run:
                single(row)
    if not problems:
        return 0
    flags = torch.stack(problems).any(dim=0).tolist()  # one read back per call
    return sum(bit for bit, bad in zip((1, 2, 4), flags) if bad)
