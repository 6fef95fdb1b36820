"""vLLM's paged KV memory, one layer at a time: gather a request's keys and values out of its blocks and scatter
them back. No vLLM import.

Two layouts, told apart by the layer tensor's shape:

- ``cpu``: vLLM's CPU attention (VEC kernels), ``[blocks, kv_heads, block_size, 2 * head_dim]``. Each block and
  head is one run of memory: the keys as ``[head_dim, block_size]`` (transposed), then the values as
  ``[block_size, head_dim]``.
- ``flash``: the CUDA backends' ``[2, blocks, block_size, kv_heads, head_dim]`` (keys, then values).

A request's token ``t`` lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``. Keys and values
here are ``[kv_heads, tokens, head_dim]``, the lynxkv cache's per-layer shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynxkv.errors import InputError


@dataclass(frozen=True)
class PagedLayout:
    name: str  # "cpu" or "flash"
    blocks: int
    block_size: int
    kv_heads: int
    head_dim: int


def layout_of(layer: torch.Tensor, *, block_size: int, kv_heads: int, head_dim: int) -> PagedLayout:
    """The layout of one layer's paged KV tensor, checked against the model's shape."""
    shape = tuple(layer.shape)
    if len(shape) == 4 and shape[1:] == (kv_heads, block_size, 2 * head_dim):
        return PagedLayout("cpu", shape[0], block_size, kv_heads, head_dim)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, kv_heads, head_dim):
        return PagedLayout("flash", shape[1], block_size, kv_heads, head_dim)
    raise InputError(f"vLLM paged KV {list(shape)}: not a layout lynxkv knows for block size {block_size}, "
                     f"{kv_heads} KV heads of {head_dim} (expected [blocks, {kv_heads}, {block_size}, "
                     f"{2 * head_dim}] or [2, blocks, {block_size}, {kv_heads}, {head_dim}])")


def _blocks_for(layout: PagedLayout, block_ids, tokens: int) -> torch.Tensor:
    n = -(-tokens // layout.block_size)
    if tokens < 1 or len(block_ids) < n:
        raise InputError(f"vLLM paged KV: {tokens} tokens need {n} blocks, the request has {len(block_ids)}")
    ids = torch.as_tensor(list(block_ids[:n]), dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= layout.blocks:
        raise InputError(f"vLLM paged KV: block id outside 0..{layout.blocks - 1}")
    return ids


def gather(layer: torch.Tensor, layout: PagedLayout, block_ids, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``tokens`` tokens of a request whose blocks are ``block_ids``: (keys, values), each ``[kv_heads,
    tokens, head_dim]``, copies in the layer's dtype and on its device."""
    ids = _blocks_for(layout, block_ids, tokens).to(layer.device)
    b, h, d = layout.block_size, layout.kv_heads, layout.head_dim
    if layout.name == "cpu":
        raw = layer.index_select(0, ids).view(-1, h, 2 * b * d)  # [n, H, keys then values]
        k = raw[..., :b * d].reshape(-1, h, d, b).permute(1, 0, 3, 2).reshape(h, -1, d)
        v = raw[..., b * d:].reshape(-1, h, b, d).permute(1, 0, 2, 3).reshape(h, -1, d)
    else:
        k, v = (layer[i].index_select(0, ids).permute(2, 0, 1, 3).reshape(h, -1, d) for i in (0, 1))
    return k[:, :tokens].contiguous(), v[:, :tokens].contiguous()


def scatter(layer: torch.Tensor, layout: PagedLayout, block_ids, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``keys`` and ``values`` (``[kv_heads, tokens, head_dim]``, any float dtype and device) into a request's
    blocks, token ``t`` at its slot; the slots past ``tokens`` in the last block are left as they are."""
    h, tokens, d = keys.shape
    if (h, d) != (layout.kv_heads, layout.head_dim) or values.shape != keys.shape:
        raise InputError(f"vLLM paged KV: keys {list(keys.shape)} and values {list(values.shape)} do not fit "
                         f"{layout.kv_heads} KV heads of {layout.head_dim}")
    ids = _blocks_for(layout, block_ids, tokens).to(layer.device)
    b = layout.block_size
    slots = torch.arange(tokens, device=layer.device)
    blk, off = ids[slots // b], slots % b
    k = keys.to(device=layer.device, dtype=layer.dtype).transpose(0, 1)  # [T, H, D]
    v = values.to(device=layer.device, dtype=layer.dtype).transpose(0, 1)
    if layout.name == "cpu":
        if not layer.is_contiguous():
            raise InputError("vLLM paged KV: the CPU layout must be contiguous")
        raw = layer.view(layout.blocks, h, 2 * b * d)  # per block and head: keys [d, b], then values [b, d]
        raw[:, :, :b * d].view(layout.blocks, h, d, b)[blk, :, :, off] = k
        raw[:, :, b * d:].view(layout.blocks, h, b, d)[blk, :, off] = v
    else:
        layer[0][blk, off] = k
        layer[1][blk, off] = v
