"""KV tensors as lynxkv passes them around: per-layer ``(keys, values)`` pairs and the dtypes a cache stores.

Every layer's keys and values are ``[kv_heads, tokens, head_dim]`` tensors (batch 1). ``transformers`` uses
``[batch, kv_heads, tokens, head_dim]``; :mod:`lynxkv.hf` converts at that boundary.
"""

from __future__ import annotations

import torch

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [H, T, D]

#: The element dtypes a cache can record, by the name the header and the CLI use.
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
