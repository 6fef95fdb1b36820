"""The streaming API: provisional (drafted) tokens, commits and retractions as a UI or serving engine sees them.

    python examples/stream_tokens.py                 # SmolLM2, a ~300-token prompt, 24 new tokens
    python examples/stream_tokens.py --model PATH --tokens 100 -n 12

The cache is quantized in memory and released over an emulated link (no files): the anchor first, the residual
after ``--residual-ms``. Every event is printed as one line; the script returns the committed token ids.
"""

from __future__ import annotations

import argparse

from lynxkv.hf import prefill
from lynxkv.hf.models import encode_prompt, load_model
from lynxkv.hf.prompts import builtin_prompt
from lynxkv.quant.scheme import get_scheme
from lynxkv.speculative import RunConfig, stream
from lynxkv.bench.simulated import split_kv, stream_bytes
from lynxkv.cache.loading import PreparedLoad


def main(argv=None) -> list[int]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=24)
    ap.add_argument("--residual-ms", type=float, default=500.0, help="when the residual lands")
    args = ap.parse_args(argv)

    loaded = load_model(args.model)
    ids = encode_prompt(loaded, builtin_prompt(loaded.tokenizer, args.tokens))
    kv, _ = prefill(loaded.model, ids)
    scheme = get_scheme()
    anchor_kv, full_kv = split_kv(kv, scheme)
    anchor_bytes, residual_bytes = stream_bytes(kv, scheme)
    load = PreparedLoad(anchor_kv, full_kv, residual_delay=args.residual_ms / 1e3, prompt_token_ids=ids.tolist(),
                        model_fingerprint=loaded.fingerprint, anchor_bytes=anchor_bytes,
                        residual_bytes=residual_bytes)

    committed: list[int] = []
    word = lambda toks: repr(loaded.tokenizer.decode(toks))  # noqa: E731
    try:
        for ev in stream(loaded.model, load, RunConfig(max_new_tokens=args.max_new_tokens), provisional=True,
                         fingerprint=loaded.fingerprint):
            if ev.kind == "draft":
                print(f"{ev.time_s:7.3f}s  draft    {word(ev.tokens)}")
            elif ev.kind == "retract":
                print(f"{ev.time_s:7.3f}s  retract  {ev.count} provisional token(s)")
            elif ev.kind == "commit":
                committed.extend(ev.tokens)
                how = f" ({ev.confirmed} confirmed drafts)" if ev.confirmed else ""
                print(f"{ev.time_s:7.3f}s  commit   {word(ev.tokens)}{how}")
            else:
                s = ev.stats
                print(f"done: {s.committed} tokens, drafted {s.drafted}, accepted {s.accepted}, "
                      f"TT1 {s.tt(1):.3f}s")
    finally:
        load.close()
    print(loaded.tokenizer.decode(committed))
    return committed


if __name__ == "__main__":
    main()
