"""Does zstd pay for .lynx pages? And how long does decoding a whole cache take?

Usage: python benchmarks/zstd_pages.py [KV.safetensors] [--scheme NAME] [--decode-tokens N] [--threads N]

With no file it prefills the offline SmolLM2 on the built-in ~1000-token prompt (about 20 s); a file holds
``layers.{i}.key`` / ``layers.{i}.value`` tensors [H, T, D]. For each scheme it prints, per part of the page
records (anchor metadata, anchor codes, residual codes), the raw bytes, the bytes after per-page zstd (level 3)
and the ratio, plus the per-page compress / decompress time of the whole segment (medians of 3). Then it times
``open_cache(...).load_kv`` (anchor-only and full, medians of 3) on a SmolLM2-shaped cache of
``--decode-tokens`` tokens (default 8192; random values, 30 layers x 3 heads x 64 dims), split into reading +
assembling the codes and the reference dequantization. ``--threads`` sets torch's intra-op threads (on a
shared, loaded machine 1 thread avoids oversubscription and gives steadier numbers).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import zstandard

from lynxkv.cache import encode_kv, open_cache
from lynxkv.format.writer import build_files
from lynxkv.quant.pack import pack_bits
from lynxkv.quant.scheme import get_scheme


def load_kv(path: str | None):
    if path:
        from safetensors.torch import load_file

        t = load_file(path)
        n = len([k for k in t if k.endswith(".key")])
        return [(t[f"layers.{i}.key"], t[f"layers.{i}.value"]) for i in range(n)]
    from lynxkv.hf import prefill
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prompts import builtin_prompt

    lm = load_model()
    kv, _ = prefill(lm.model, encode_prompt(lm, builtin_prompt(lm.tokenizer, tokens=1000)))
    return kv


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def page_parts(enc) -> dict[str, list[bytes]]:
    """The page records of every (layer, page), split into the three parts whose statistics differ."""
    s = enc.scheme
    parts = {"anchor meta": [], "anchor codes": [], "residual codes": []}
    for keys, values in enc.layers:
        for p in range(enc.pages_per_layer):
            t0, t1 = p * s.page, min((p + 1) * s.page, enc.tokens)
            k, v = keys.tokens(t0, t1, s.chunk), values.tokens(t0, t1, s.chunk)
            parts["anchor meta"].append(b"".join(m.contiguous().numpy().tobytes()
                                                 for m in (k.offset, k.scale, v.offset, v.scale)))
            parts["anchor codes"].append(pack_bits(k.anchor, s.anchor_bits).numpy().tobytes()
                                         + pack_bits(v.anchor, s.anchor_bits).numpy().tobytes())
            parts["residual codes"].append(pack_bits(k.residual, s.residual_bits).numpy().tobytes()
                                           + pack_bits(v.residual, s.residual_bits).numpy().tobytes())
    return parts


def main(argv: list[str]) -> None:
    path = next((a for i, a in enumerate(argv)
                 if not a.startswith("--") and (i == 0 or not argv[i - 1].startswith("--"))), None)
    schemes = [argv[argv.index("--scheme") + 1]] if "--scheme" in argv else ["default", "paper"]
    decode_tokens = int(argv[argv.index("--decode-tokens") + 1]) if "--decode-tokens" in argv else 8192
    if "--threads" in argv:
        torch.set_num_threads(int(argv[argv.index("--threads") + 1]))
    kv = load_kv(path)
    print(f"KV: {len(kv)} layers x {tuple(kv[0][0].shape)} {kv[0][0].dtype}; zstd {zstandard.__version__} level 3, "
          "one frame per page")
    print(f"{'scheme':8} {'part':15} {'raw bytes':>10} {'zstd bytes':>10} {'ratio':>6} {'compress s':>10} "
          f"{'decompress s':>12}")
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    files = {}
    for name in schemes:
        enc = encode_kv(kv, get_scheme(name))
        parts = page_parts(enc)
        for part, pages in parts.items():
            packed = [cctx.compress(p) for p in pages]
            raw, z = sum(map(len, pages)), sum(map(len, packed))
            tc = median_time(lambda: [cctx.compress(p) for p in pages])
            td = median_time(lambda: [dctx.decompress(p) for p in packed])
            print(f"{name:8} {part:15} {raw:>10} {z:>10} {raw / z:>6.3f} {tc:>10.3f} {td:>12.3f}")
        files[name] = [build_files(enc, single_file=True, zstd=z) for z in (False, True)]
    print("\nas the writer stores them (whole page records, zstd kept only where smaller):")
    print(f"{'scheme':8} {'file':22} {'raw':>10} {'--zstd':>10} {'ratio':>6} {'bits/el raw':>11} {'bits/el zstd':>12}")
    elements = 2 * len(kv) * kv[0][0].numel()
    for name, (raw, z) in files.items():
        ra, za = (f.header.header_length + f.header.segments[0].length for f in (raw, z))
        rr, zr = len(raw.anchor) - ra, len(z.anchor) - za
        for what, x, y in (("anchor (header+pages)", ra, za), ("residual", rr, zr), ("total", ra + rr, za + zr)):
            print(f"{name:8} {what:22} {x:>10} {y:>10} {x / y:>6.3f} {8 * x / elements:>11.3f} "
                  f"{8 * y / elements:>12.3f}")

    big = [(torch.randn(3, decode_tokens, 64), torch.randn(3, decode_tokens, 64)) for _ in range(30)]
    built = build_files(encode_kv(big), single_file=True)
    with open_cache(built.anchor) as cache:
        for anchor_only in (True, False):
            t_read = median_time(lambda: cache.load_encoded(anchor_only=anchor_only))
            enc = cache.load_encoded(anchor_only=anchor_only)
            t_deq = median_time(lambda: enc.dequantize(anchor_only=anchor_only))
            t_all = median_time(lambda: cache.load_kv(anchor_only=anchor_only))
            print(f"load_kv 30 x 3 x {decode_tokens} x 64 (K and V, {len(built.anchor) / 1e6:.1f} MB single file, "
                  f"{torch.get_num_threads()} threads), {'anchor-only' if anchor_only else 'full'}: {t_all:.2f} s = "
                  f"read+assemble {t_read:.2f} s + dequantize {t_deq:.2f} s (medians of 3)")


if __name__ == "__main__":
    main(sys.argv[1:])
