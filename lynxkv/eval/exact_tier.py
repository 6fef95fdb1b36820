"""The exact tier's row of the task tables: Lynx's full code plus the exact segment, stored and read
back through the cache API users call.

Unlike the per-tensor codecs of :mod:`lynxkv.eval.baselines` (fp32 in, fp32 out), the exact tier rebuilds the
cache in its own dtype, so it takes the model's KV as the model produced it: :func:`lynxkv.cache.save_cache`
with ``exact=True`` into a temporary directory (removed before returning), then ``load_kv(exact=True)``, which
checks every page against the CRC of its original bytes. Its bits per element are the full code's (the scheme's
own accounting, as for ``lynx-default``) plus the whole exact file (``.lynxe``: header, index and zstd pages)
over the keys' and values' elements; they depend on the data, so a task run reports their mean.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from lynxkv.cache import open_cache, save_cache
from lynxkv.cache.kv import KVPairs
from lynxkv.eval.baselines import Lynx
from lynxkv.quant.scheme import get_scheme

EXACT_CODEC = "lynx-default-exact"


@dataclass(frozen=True)
class ExactTier:
    """Anchor + residual + exact segment of a scheme: the original values bit for bit."""

    name: str = EXACT_CODEC
    scheme_name: str = "default"

    @property
    def description(self) -> str:
        return f"lynx full + exact tier (the original values bit for bit): {self.scheme.describe()}"

    @property
    def scheme(self):
        return get_scheme(self.scheme_name)

    def store(self, kv: KVPairs) -> tuple[KVPairs, float]:
        """``kv`` (per layer ``[H, T, D]``, the model's dtype) saved with its exact segment and loaded back exactly:
        ``(the loaded KV, bits per element)``."""
        with tempfile.TemporaryDirectory(prefix="lynxkv-exact-") as folder:
            path = Path(folder) / "task.lynx"
            save_cache(path, kv, self.scheme, exact=True)
            with open_cache(path) as cache:
                back = [(k.clone(), v.clone()) for k, v in cache.load_kv(exact=True)]
            exact_bytes = path.with_suffix(".lynxe").stat().st_size
        elements = sum(k.numel() + v.numel() for k, v in kv)
        full = Lynx(self.name, self.scheme).bits_per_element(tuple(kv[0][0].shape))
        return back, full + 8.0 * exact_bytes / max(elements, 1)
