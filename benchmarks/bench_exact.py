"""The exact tier: anchor + residual + exact against the raw bytes and zstd of the same tensors.

Usage: python benchmarks/bench_exact.py [--tokens N] [--repeats N] [--threads N] [--no-model] [--corpus C]

Both exact codings are measured side by side: coding 2 (rANS per context, format 1.5, the default) and coding 1
(byte planes in zstd-1 frames, format 1.4, ``exact_coding="planes"``).

Two bf16 caches: the KV of the offline SmolLM2 prefilled in bf16 on ``--tokens`` tokens (default 1000; about 40 s
to load and prefill) of the held-out prose (``--corpus prose``, the default: :func:`lynxkv.eval.prose.docstring_text`,
which had no part in choosing the coding) or of the built-in pydoc prompt the coding was chosen on
(``--corpus pydoc``), and a Llama-shaped random-ish cache (8 layers x 8 KV heads x
``--tokens`` x 128: Gaussian values with log-normal per-channel scales, the keys with a few 8x outlier
channels). Everything goes through the public API (``save_cache(..., exact=True)``, ``open_cache(...).load_kv``).
It prints, per cache, the bytes of each segment and of zstd-1 / zstd-3 of the raw tensors (one frame per tensor)
and the speeds, medians of ``--repeats`` (default 3) interleaved runs:

- encode: the exact segment's share of ``save_cache`` (with the exact segment minus without), as MB/s of raw
  bf16, beside zstd-1's compression of the raw tensors;
- decode: ``load_kv(exact=True)`` (the whole cache, bf16 bit for bit: the full code's decoding and the exact
  segment on it), beside zstd-1's decompression of the raw tensors.

Then the rANS coder of coding 2 alone on the same pages (``encode_body`` / ``decode_body``, one thread, medians of
the same repeats), beside the rate the decode target asks of the whole load: what bounds the speeds above.
Then the candidates measured for coding the remainder (sizes only, page by page as the format stores it), on the
same caches. ``--sweep`` adds the choices inside coding 2: the remainder's order-0 entropy with each context, and
the bytes the Python coder writes with other literal counts, shared-context thresholds and frequency precisions
(slow: a Python loop per element). ``--threads`` sets
torch's intra-op threads (default 1: the figures in docs/format.md came from a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
import zstandard

from lynxkv.cache import open_cache, save_cache
from lynxkv.format.exact_records import frame_splits
from lynxkv.format.records import compress_frames
from lynxkv.quant import rans
from lynxkv.quant.rans import decode_body, encode_body
from lynxkv.quant.remainder import element_order, group_sizes, remainder_planes
from zstd_pages import median_time  # this folder's timer: benchmarks run as scripts from it
from lynxkv.quant.scheme import DEFAULT

CODINGS = ("rans", "planes")  # exact coding 2 (the default), coding 1


def smollm2_kv(tokens: int, corpus: str):
    from lynxkv.hf.models import encode_prompt, load_model
    from lynxkv.hf.prefill import prefill
    from lynxkv.hf.prompts import builtin_prompt

    loaded = load_model(None, dtype=torch.bfloat16)
    if corpus == "pydoc":
        ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, tokens))
    else:
        from lynxkv.eval.prose import docstring_text

        ids = torch.tensor([loaded.tokenizer(docstring_text()).input_ids[:tokens]])
    kv, _ = prefill(loaded.model, ids)
    return [(k.contiguous(), v.contiguous()) for k, v in kv]


def llama_like_kv(tokens: int, layers: int = 8, heads: int = 8, dim: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = []
    for _ in range(layers):
        scale = torch.exp(0.5 * torch.randn(heads, 1, dim, generator=g))
        kscale = scale.clone()
        kscale[:, :, torch.randint(0, dim, (4,), generator=g)] *= 8  # outlier key channels
        k = torch.randn(heads, tokens, dim, generator=g) * kscale
        v = torch.randn(heads, tokens, dim, generator=g) * scale
        kv.append((k.to(torch.bfloat16), v.to(torch.bfloat16)))
    return kv


def raw_frames(kv) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for pair in kv for t in pair]


def measure(name: str, kv, repeats: int, workdir: Path) -> dict:
    frames = raw_frames(kv)
    raw = sum(map(len, frames))
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    c1 = [z1.compress(f) for f in frames]
    c3 = [z3.compress(f) for f in frames]
    d = zstandard.ZstdDecompressor()
    plain = workdir / f"{name}-plain.lynx"
    paths = {coding: workdir / coding / f"{name}.lynx" for coding in CODINGS}  # one name: the same header lengths
    for path in paths.values():
        path.parent.mkdir(exist_ok=True)
    t = {k: [] for k in ("save_plain", "z1_c", "z1_d", "load_full",
                         *(f"{what}_{coding}" for coding in CODINGS for what in ("save", "load")))}
    for _ in range(repeats):  # interleaved
        t["save_plain"].append(median_time(lambda: save_cache(plain, kv), 1))
        for coding, path in paths.items():
            t[f"save_{coding}"].append(median_time(lambda: save_cache(path, kv, exact=True, exact_coding=coding), 1))
        t["z1_c"].append(median_time(lambda: [z1.compress(f) for f in frames], 1))
        t["z1_d"].append(median_time(lambda: [d.decompress(f) for f in c1], 1))
        for coding, path in paths.items():
            with open_cache(path) as cache:
                t[f"load_{coding}"].append(median_time(lambda: cache.load_kv(exact=True), 1))
                if coding == CODINGS[0]:
                    t["load_full"].append(median_time(lambda: cache.load_kv(), 1))
    with open_cache(paths[CODINGS[0]]) as cache:
        pages = list(_pages(kv, cache.load_kv(), DEFAULT.page))
    bodies = [encode_body(x, p) for x, p in pages]
    for _ in range(repeats):  # the rANS coder alone (coding 2's C kernels, one thread), page by page
        t.setdefault("coder_enc", []).append(median_time(lambda: [encode_body(x, p) for x, p in pages], 1))
        t.setdefault("coder_dec", []).append(median_time(
            lambda: [decode_body(b, p, "") for b, (_, p) in zip(bodies, pages)], 1))
    med = {k: statistics.median(v) for k, v in t.items()}
    out = dict(name=name, raw=raw, zstd1=sum(map(len, c1)), zstd3=sum(map(len, c3)), elements=raw // 2,
               z1_compress_s=med["z1_c"], z1_decompress_s=med["z1_d"], load_full_s=med["load_full"],
               coder_enc_s=med["coder_enc"], coder_dec_s=med["coder_dec"])
    for coding, path in paths.items():
        with open_cache(path) as cache:
            info = cache.info
            back = cache.load_kv(exact=True)
            out["predicted"] = cache.load_kv()
        out[coding] = dict(
            anchor=info.anchor_bytes, residual=info.residual_bytes, exact=info.exact_bytes,
            version=info.format_version, exact_ok=all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                                      for pa, pb in zip(kv, back) for a, b in zip(pa, pb)),
            encode_s=max(med[f"save_{coding}"] - med["save_plain"], 1e-9), save_s=med[f"save_{coding}"],
            load_s=med[f"load_{coding}"])
    return out


def candidates(kv, predicted, page: int) -> dict[str, int]:
    """Bytes of the remainder coded in each candidate way, page by page (K then V of a page together, as the
    exact records hold them; the 4-byte CRC of each record left out)."""
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    names = ["ordered difference, exponent order, byte planes, zstd-1 one frame",
             "ordered difference, exponent order, byte planes, zstd-3 one frame",
             "ordered difference, exponent order, zstd-1 frames per run (coding 1)",
             "ordered difference, element order, rANS per (K/V, exponent) context (coding 2)",
             "ordered difference, element order, byte planes, zstd-1",
             "ordered difference, element order, interleaved bytes, zstd-1",
             "XOR of the bits, element order, byte planes, zstd-1",
             "original bits, byte planes, zstd-1 (no prediction)"]
    out = dict.fromkeys(names, 0)
    for (k, v), (pk, pv) in zip(kv, predicted):
        for p0 in range(0, k.shape[1], page):
            x = torch.cat((k[:, p0:p0 + page], v[:, p0:p0 + page])).reshape(-1)
            p = torch.cat((pk[:, p0:p0 + page], pv[:, p0:p0 + page])).reshape(-1)
            planes = remainder_planes(x, p)
            unsorted = torch.empty_like(planes)
            unsorted[:, element_order(p)] = planes
            out[names[0]] += len(z1.compress(planes.numpy().tobytes()))
            out[names[1]] += len(z3.compress(planes.numpy().tobytes()))
            splits = [s - 4 for s in frame_splits(group_sizes(p), p.numel(), 2)]  # as the writer splits a record
            out[names[2]] += len(compress_frames(planes.numpy().tobytes(), splits, 1))
            out[names[3]] += len(encode_body(x, p))
            out[names[4]] += len(z1.compress(unsorted.numpy().tobytes()))
            out[names[5]] += len(z1.compress(unsorted.t().contiguous().numpy().tobytes()))
            xor = (x.view(torch.int16) ^ p.view(torch.int16)).view(torch.uint8).view(-1, 2)
            out[names[6]] += len(z1.compress(xor.t().contiguous().numpy().tobytes()))
            bits = x.view(torch.uint8).view(-1, 2)
            out[names[7]] += len(z1.compress(bits.t().contiguous().numpy().tobytes()))
    return out


def _pages(kv, predicted, page: int):
    """(original, prediction) of each page, K then V flattened, as the exact records hold them."""
    for (k, v), (pk, pv) in zip(kv, predicted):
        for p0 in range(0, k.shape[1], page):
            yield (torch.cat((k[:, p0:p0 + page], v[:, p0:p0 + page])).reshape(-1),
                   torch.cat((pk[:, p0:p0 + page], pv[:, p0:p0 + page])).reshape(-1))


def _entropy(z: torch.Tensor, context: torch.Tensor) -> float:
    """Order-0 entropy in bits of ``z`` given ``context`` (both int64, one page): the sum over contexts."""
    total = 0.0
    for c in torch.unique(context):
        counts = torch.bincount(z[context == c]).double()
        counts = counts[counts > 0]
        total -= float((counts * torch.log2(counts / counts.sum())).sum())
    return total


def _scale_keys(kv, scheme):
    """Per layer, (keys, values) ``[H, T, D]`` int64: the bf16 exponent of each element's chunk scale under
    ``scheme`` (in the rotated space for rotated keys), through the reference quantizer."""
    from lynxkv.quant import reference

    out = []
    for k, v in kv:
        pair = []
        for kind, x in (("key", k), ("value", v)):
            enc = reference.quantize(x, scheme, kind)
            s = reference.spread(enc.scale, scheme.chunk, enc.axis, x.shape[1], x.shape[2]).to(torch.bfloat16)
            pair.append((s.view(torch.int16).to(torch.int64) >> 7) & 0xFF)
        out.append(tuple(pair))
    return out


def sweep(kv, predicted, page: int) -> dict[str, float]:
    """Bits per element of the remainder: order-0 entropies with each context, then coding 2's bytes (Python
    coder, CRCs included) with its literal count, shared-context threshold and frequency precision varied.
    Two contexts coding 2 does not use (its decoder would need each element's chunk scale) bound what knowing the
    quantization step buys: the prediction's exponent less its chunk scale's (the step in units of the
    prediction's last bit), and the two exponents as a pair."""
    out: dict[str, float] = {}
    pages = list(_pages(kv, predicted, page))
    scales = [x for _, x in _pages(kv, _scale_keys(kv, DEFAULT), page)]
    n = sum(x.numel() for x, _ in pages)
    ent = {"entropy, no context": 0.0, "entropy given the exponent": 0.0,
           "entropy given the exponent, K and V apart": 0.0,
           "entropy given the exponent less the chunk scale's, K and V apart": 0.0,
           "entropy given the exponent and the chunk scale's, K and V apart": 0.0}
    for (x, p), sk in zip(pages, scales):
        z = torch.from_numpy(rans._zigzag(x, p).astype("int64"))
        key = (p.view(torch.int16).to(torch.int64) >> 7) & 0xFF
        half = (torch.arange(len(z)) >= len(z) // 2).to(torch.int64)
        contexts = (torch.zeros_like(z), key, half * 256 + key, half * 512 + (key - sk + 256),
                    (half * 256 + key) * 256 + sk)
        for name, ctx in zip(ent, contexts):
            ent[name] += _entropy(z, ctx)
    out.update({name: bits / n for name, bits in ent.items()})
    configs = {"coding 2 as specified (16 literals, from 256, 10-bit)": {},
               "8 literals": {"LITERALS": 8}, "32 literals": {"LITERALS": 32},
               "shared context under 64": {"MIN_CONTEXT": 64}, "under 128": {"MIN_CONTEXT": 128},
               "under 512": {"MIN_CONTEXT": 512}, "12-bit frequencies": {"PROB_BITS": 12, "PROB_TOTAL": 4096}}
    for name, change in configs.items():
        saved = {k: getattr(rans, k) for k in change}
        try:
            for k, v in change.items():
                setattr(rans, k, v)
            out[name] = 8 * sum(len(rans.reference_encode(x, p)) + 4 for x, p in pages) / n
        finally:
            for k, v in saved.items():
                setattr(rans, k, v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-model", action="store_true", help="skip SmolLM2 (only the Llama-shaped cache)")
    ap.add_argument("--sweep", action="store_true", help="also the choices inside coding 2 (slow)")
    ap.add_argument("--corpus", choices=["prose", "pydoc"], default="prose",
                    help="SmolLM2's prompt: held-out prose (default) or the pydoc prompt the coding was chosen on")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caches = [] if args.no_model else [(f"SmolLM2 bf16 {args.corpus}", smollm2_kv(args.tokens, args.corpus))]
    caches.append(("Llama-shaped bf16", llama_like_kv(args.tokens)))
    mb = 1e6
    with tempfile.TemporaryDirectory() as d:
        rows = [(measure(name.split()[0], kv, args.repeats, Path(d)), name, kv) for name, kv in caches]
    print(f"sizes (bytes; ratio to the raw bf16 bytes), {args.tokens} tokens, torch threads {args.threads}")
    print(f"{'cache':<20} {'coding':<7} {'raw':>12} {'zstd-1':>18} {'zstd-3':>18} {'anchor+residual':>20} "
          f"{'+exact':>12} {'A+R+E':>20} {'bits/el':>8} {'<=0.75':>6} {'<zstd-3':>7} exact?")
    for r, name, _ in rows:
        f = lambda n: f"{n:,} ({n / r['raw']:.3f})"  # noqa: E731
        for coding in CODINGS:
            e = r[coding]
            total = e["anchor"] + e["residual"] + e["exact"]
            print(f"{name:<20} {coding:<7} {r['raw']:>12,} {f(r['zstd1']):>18} {f(r['zstd3']):>18} "
                  f"{f(e['anchor'] + e['residual']):>20} {e['exact']:>12,} {f(total):>20} "
                  f"{8 * total / r['elements']:>8.2f} {'yes' if total <= 0.75 * r['raw'] else 'no':>6} "
                  f"{'yes' if total < r['zstd3'] else 'no':>7} "
                  f"{'bit-identical' if e['exact_ok'] else 'MISMATCH'} (format {e['version']})")
    print("\nspeeds (MB/s of raw bf16, medians of", args.repeats, "interleaved runs; ratio: to zstd-1, target >= 1 "
          "for encode and >= 2 for decode)")
    print(f"{'cache':<20} {'coding':<7} {'exact encode':>13} {'zstd-1 comp':>12} {'ratio':>6} | "
          f"{'decode exact':>13} {'zstd-1 decomp':>14} {'ratio':>6} | {'save_cache+exact':>16} {'load_kv full':>13}")
    for r, name, _ in rows:
        s = lambda sec: r["raw"] / sec / mb  # noqa: E731
        for coding in CODINGS:
            e = r[coding]
            print(f"{name:<20} {coding:<7} {s(e['encode_s']):>13.0f} {s(r['z1_compress_s']):>12.0f} "
                  f"{r['z1_compress_s'] / e['encode_s']:>6.2f} | {s(e['load_s']):>13.0f} "
                  f"{s(r['z1_decompress_s']):>14.0f} {r['z1_decompress_s'] / e['load_s']:>6.2f} | "
                  f"{s(e['save_s']):>16.0f} {s(r['load_full_s']):>13.0f}")
    print("\nthe rANS coder of coding 2 alone (every page's encode_body / decode_body, one thread): what bounds the "
          "speeds above")
    for r, name, _ in rows:
        per = lambda sec: sec / r["elements"] * 1e9  # noqa: E731
        print(f"{name:<20} encode {r['raw'] / r['coder_enc_s'] / mb:>6.0f} MB/s ({per(r['coder_enc_s']):.2f} ns/element) "
              f"| decode {r['raw'] / r['coder_dec_s'] / mb:>6.0f} MB/s ({per(r['coder_dec_s']):.2f} ns/element) | "
              f"2x zstd-1 decompress needs {2 * r['raw'] / r['z1_decompress_s'] / mb:.0f} MB/s for the whole load "
              f"({per(r['z1_decompress_s'] / 2):.2f} ns/element), the full code alone decodes at "
              f"{r['raw'] / r['load_full_s'] / mb:.0f} MB/s")
    print("\ncandidates for the remainder (bytes of the exact payload alone; bits per element)")
    for r, name, kv in rows:
        for cand, n in candidates(kv, r["predicted"], DEFAULT.page).items():
            print(f"{name:<20} {cand:<70} {n:>12,} {8 * n / r['elements']:>6.2f}")

    if args.sweep:
        print("\nchoices inside coding 2 (bits per element of the exact payload)")
        for r, name, kv in rows:
            for what, bits in sweep(kv, r["predicted"], DEFAULT.page).items():
                print(f"{name:<20} {what:<70} {bits:>6.3f}")


if __name__ == "__main__":
    main()
