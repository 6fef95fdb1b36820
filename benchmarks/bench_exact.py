"""The exact tier: anchor + residual + exact against the raw bytes and zstd of the same tensors.

Usage: python benchmarks/bench_exact.py [--tokens N] [--repeats N] [--threads N] [--no-model] [--corpus C]
       [--libraries]

Two bf16 caches: the KV of the offline SmolLM2 prefilled in bf16 on ``--tokens`` tokens (default 1000; about 40 s
to load and prefill) of held-out prose (``--corpus prose``, the default: :func:`lynxkv.eval.prose.docstring_text`)
or of the built-in pydoc prompt (``--corpus pydoc``), and a Llama-shaped random-ish cache (8 layers x 8 KV heads x
``--tokens`` x 128: Gaussian values with log-normal per-channel scales, the keys with a few 8x outlier
channels). Everything goes through the public API (``save_cache(..., exact=True)``, ``open_cache(...).load_kv``).
It prints, per cache, the bytes of each segment and of zstd-1 / zstd-3 of the raw tensors (one frame per tensor)
and the speeds, medians of ``--repeats`` (default 3) interleaved runs:

- encode: the exact segment's share of ``save_cache`` (with the exact segment minus without), as MB/s of raw
  bf16, beside zstd-1's compression of the raw tensors;
- decode: ``load_kv(exact=True)`` (the whole cache, bf16 bit for bit: the full code's decoding and the exact
  segment on it), beside zstd-1's decompression of the raw tensors.

Then other ways of coding the same remainder (sizes only, page by page as the format stores it). ``--libraries``
adds two maintained libraries, where they are installed (neither is a dependency of lynxkv): ``constriction``
(Rust ANS) coding the remainder as symbols with a table per (K or V, prediction exponent) context, the coder alone,
and ``zipnn`` compressing the raw bf16 tensors without any prediction. ``--threads`` sets torch's intra-op threads
(default 1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
import zstandard

from lynxkv.cache import open_cache, save_cache
from lynxkv.format.exact_records import frame_splits
from lynxkv.format.records import compress_frames
from lynxkv.quant.remainder import element_order, group_sizes, remainder_planes
from zstd_pages import median_time  # this folder's timer: benchmarks run as scripts from it
from lynxkv.quant.scheme import DEFAULT


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
    plain, path = workdir / f"{name}-plain.lynx", workdir / f"{name}.lynx"
    t = {k: [] for k in ("save_plain", "save", "z1_c", "z1_d", "load", "load_full")}
    for _ in range(repeats):  # interleaved
        t["save_plain"].append(median_time(lambda: save_cache(plain, kv), 1))
        t["save"].append(median_time(lambda: save_cache(path, kv, exact=True), 1))
        t["z1_c"].append(median_time(lambda: [z1.compress(f) for f in frames], 1))
        t["z1_d"].append(median_time(lambda: [d.decompress(f) for f in c1], 1))
        with open_cache(path) as cache:
            t["load"].append(median_time(lambda: cache.load_kv(exact=True), 1))
            t["load_full"].append(median_time(lambda: cache.load_kv(), 1))
    med = {k: statistics.median(v) for k, v in t.items()}
    with open_cache(path) as cache:
        info = cache.info
        back = cache.load_kv(exact=True)
        predicted = cache.load_kv()
    return dict(name=name, raw=raw, zstd1=sum(map(len, c1)), zstd3=sum(map(len, c3)), elements=raw // 2,
                z1_compress_s=med["z1_c"], z1_decompress_s=med["z1_d"], load_full_s=med["load_full"],
                predicted=predicted, anchor=info.anchor_bytes, residual=info.residual_bytes, exact=info.exact_bytes,
                version=info.format_version, encode_s=max(med["save"] - med["save_plain"], 1e-9),
                save_s=med["save"], load_s=med["load"],
                exact_ok=all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                             for pa, pb in zip(kv, back) for a, b in zip(pa, pb)))


def candidates(kv, predicted, page: int) -> dict[str, int]:
    """Bytes of the remainder coded in each candidate way, page by page (K then V of a page together, as the
    exact records hold them; the 4-byte CRC of each record left out)."""
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    names = ["ordered difference, exponent order, byte planes, zstd-1 one frame",
             "ordered difference, exponent order, byte planes, zstd-3 one frame",
             "ordered difference, exponent order, zstd-1 frames per run (the format)",
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
            out[names[3]] += len(z1.compress(unsorted.numpy().tobytes()))
            out[names[4]] += len(z1.compress(unsorted.t().contiguous().numpy().tobytes()))
            xor = (x.view(torch.int16) ^ p.view(torch.int16)).view(torch.uint8).view(-1, 2)
            out[names[5]] += len(z1.compress(xor.t().contiguous().numpy().tobytes()))
            bits = x.view(torch.uint8).view(-1, 2)
            out[names[6]] += len(z1.compress(bits.t().contiguous().numpy().tobytes()))
    return out


def _pages(kv, predicted, page: int):
    """(original, prediction) of each page, K then V flattened, as the exact records hold them."""
    for (k, v), (pk, pv) in zip(kv, predicted):
        for p0 in range(0, k.shape[1], page):
            yield (torch.cat((k[:, p0:p0 + page], v[:, p0:p0 + page])).reshape(-1),
                   torch.cat((pk[:, p0:p0 + page], pv[:, p0:p0 + page])).reshape(-1))



def _symbols(x: torch.Tensor, p: torch.Tensor) -> tuple[list, int]:
    """The remainder of one bf16 page as an entropy coder sees it: per context (K or V, the prediction's exponent
    field; contexts under 256 elements share one), the symbols (``z`` below 16, else 16 + 2·(bit length − 5) +
    the bit under the top one), and the extra bits the symbols leave raw."""
    o, q = x.view(torch.int16).to(torch.int64), p.view(torch.int16).to(torch.int64)
    d = ((o ^ ((o >> 15) & 0x7FFF)) - (q ^ ((q >> 15) & 0x7FFF))) & 0xFFFF
    d = torch.where(d >= 1 << 15, d - (1 << 16), d)
    z = (((d << 1) ^ (d >> 15)) & 0xFFFF).numpy()
    length = np.zeros(z.shape, dtype=np.int64)
    length[z > 0] = np.floor(np.log2(z[z > 0])).astype(np.int64) + 1
    big = z >= 16
    extra = np.where(big, length - 2, 0)
    second = (z >> np.maximum(extra, 0)) & 1
    sym = np.where(big, 16 + 2 * (length - 5) + second, z).astype(np.int32)
    pair = (np.arange(len(z)) >= len(z) // 2) * 256 + ((q >> 7) & 0xFF).numpy()
    count = np.bincount(pair, minlength=512)
    pair = np.where(count[pair] >= 256, pair, -1)
    return [sym[pair == c] for c in np.unique(pair)], int(extra.sum())


def libraries(kv, predicted, page: int, repeats: int) -> dict[str, tuple[int, float, float]]:
    """(bytes, encode s, decode s) of each maintained library that is installed: constriction's ANS coder on the
    remainder's symbols (tables counted as 81 bytes a context, the extra bits raw), zipnn on the raw tensors."""
    out = {}
    try:
        import constriction
    except ImportError:
        constriction = None
    if constriction is not None:
        pages = [_symbols(x, p) for x, p in _pages(kv, predicted, page)]
        models = [[constriction.stream.model.Categorical(np.bincount(s, minlength=40).astype(np.float64),
                                                         perfect=False) for s in groups] for groups, _ in pages]

        def encode():
            words = []
            for (groups, _), mods in zip(pages, models):
                coder = constriction.stream.stack.AnsCoder()
                for s, m in zip(reversed(groups), reversed(mods)):
                    coder.encode_reverse(s, m)
                words.append(coder.get_compressed())
            return words

        words = encode()

        def decode():
            for (groups, _), mods, w in zip(pages, models, words):
                coder = constriction.stream.stack.AnsCoder(w)
                for s, m in zip(groups, mods):
                    coder.decode(m, len(s))

        size = sum(w.nbytes for w in words) + sum(81 * len(g) + -(-b // 8) for g, b in pages)
        out["constriction 0.5 ANS, symbols per context (coder alone)"] = (
            size, statistics.median(median_time(encode, 1) for _ in range(repeats)),
            statistics.median(median_time(decode, 1) for _ in range(repeats)))
    try:
        import zipnn
    except ImportError:
        zipnn = None
    if zipnn is not None:
        frames = raw_frames(kv)
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
        packed = [z.compress(f) for f in frames]
        out["zipnn 0.5 on the raw bf16 tensors (no prediction, no anchor or residual)"] = (
            sum(map(len, packed)), statistics.median(median_time(lambda: [z.compress(f) for f in frames], 1)
                                                     for _ in range(repeats)),
            statistics.median(median_time(lambda: [z.decompress(f) for f in packed], 1) for _ in range(repeats)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-model", action="store_true", help="skip SmolLM2 (only the Llama-shaped cache)")
    ap.add_argument("--libraries", action="store_true", help="also constriction and zipnn, where installed")
    ap.add_argument("--corpus", choices=["prose", "pydoc"], default="prose",
                    help="SmolLM2's prompt: held-out prose (default) or the built-in pydoc prompt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caches = [] if args.no_model else [(f"SmolLM2 bf16 {args.corpus}", smollm2_kv(args.tokens, args.corpus))]
    caches.append(("Llama-shaped bf16", llama_like_kv(args.tokens)))
    mb = 1e6
    with tempfile.TemporaryDirectory() as d:
        rows = [(measure(name.split()[0], kv, args.repeats, Path(d)), name, kv) for name, kv in caches]
    print(f"sizes (bytes; ratio to the raw bf16 bytes), {args.tokens} tokens, torch threads {args.threads}")
    print(f"{'cache':<20} {'raw':>12} {'zstd-1':>18} {'zstd-3':>18} {'anchor+residual':>20} {'+exact':>12} "
          f"{'A+R+E':>20} {'bits/el':>8} exact?")
    for r, name, _ in rows:
        f = lambda n: f"{n:,} ({n / r['raw']:.3f})"  # noqa: E731
        total = r["anchor"] + r["residual"] + r["exact"]
        print(f"{name:<20} {r['raw']:>12,} {f(r['zstd1']):>18} {f(r['zstd3']):>18} "
              f"{f(r['anchor'] + r['residual']):>20} {r['exact']:>12,} {f(total):>20} "
              f"{8 * total / r['elements']:>8.2f} {'bit-identical' if r['exact_ok'] else 'MISMATCH'} "
              f"(format {r['version']})")
    print("\nspeeds (MB/s of raw bf16, medians of", args.repeats, "interleaved runs; ratio: to zstd-1)")
    print(f"{'cache':<20} {'exact encode':>13} {'zstd-1 comp':>12} {'ratio':>6} | {'decode exact':>13} "
          f"{'zstd-1 decomp':>14} {'ratio':>6} | {'save_cache+exact':>16} {'load_kv full':>13}")
    for r, name, _ in rows:
        s = lambda sec: r["raw"] / sec / mb  # noqa: E731
        print(f"{name:<20} {s(r['encode_s']):>13.0f} {s(r['z1_compress_s']):>12.0f} "
              f"{r['z1_compress_s'] / r['encode_s']:>6.2f} | {s(r['load_s']):>13.0f} "
              f"{s(r['z1_decompress_s']):>14.0f} {r['z1_decompress_s'] / r['load_s']:>6.2f} | "
              f"{s(r['save_s']):>16.0f} {s(r['load_full_s']):>13.0f}")
    print("\ncandidates for the remainder (bytes of the exact payload alone; bits per element)")
    for r, name, kv in rows:
        for cand, n in candidates(kv, r["predicted"], DEFAULT.page).items():
            print(f"{name:<20} {cand:<70} {n:>12,} {8 * n / r['elements']:>6.2f}")
    if args.libraries:
        print("\nmaintained libraries (bytes; bits per element; encode and decode MB/s of raw bf16, one thread)")
        for r, name, kv in rows:
            for lib, (n, enc_s, dec_s) in libraries(kv, r["predicted"], DEFAULT.page, args.repeats).items():
                print(f"{name:<20} {lib:<75} {n:>12,} {8 * n / r['elements']:>6.2f} "
                      f"{r['raw'] / enc_s / mb:>6.0f} {r['raw'] / dec_s / mb:>6.0f}")


if __name__ == "__main__":
    main()
