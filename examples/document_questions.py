"""Cache a document once, then ask several questions about it: each question is new text after the cached prompt.

    python examples/document_questions.py                    # SmolLM2, a ~1000-token document, two questions
    python examples/document_questions.py --model PATH --tokens 200 -n 16 --question "..." --question "..."

The document is prefilled and stored once (``doc.lynx`` + ``doc.lynxr``). For every question the cache is
loaded progressively under an emulated link: the question's tokens are prefilled on the anchor while the
residual streams, drafting starts right after, and one forward over [question + drafts] on the full cache
verifies. The same cache also goes to ``model.generate`` through :func:`lynxkv.hf.to_dynamic_cache`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from lynxkv import open_cache, save_cache
from lynxkv.hf import continuation_ids, prefill, to_dynamic_cache
from lynxkv.hf.models import encode_prompt, load_model
from lynxkv.hf.prompts import document
from lynxkv.cache.kv import TORCH_DTYPES
from lynxkv.speculative import RunConfig, run
from lynxkv.bench.emulated_link import link_at
from lynxkv.stream.progressive import open_progressive

QUESTIONS = ("\n\nQuestion: What is this documentation about?\nAnswer:",
             "\n\nQuestion: Name one keyword that the text explains.\nAnswer:")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name/path (default: offline SmolLM2)")
    ap.add_argument("--dtype", default="fp32", choices=list(TORCH_DTYPES), help="the model's compute dtype")
    ap.add_argument("--tokens", type=int, default=1000, help="about how many tokens of documentation to cache")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32)
    ap.add_argument("--question", action="append", help="a question (repeatable; default: two built-in ones)")
    ap.add_argument("--bandwidth", default="100Mbps", help="emulated link for each load")
    ap.add_argument("--dir", default=None, help="where to write the cache (default: a temporary directory)")
    args = ap.parse_args(argv)

    loaded = load_model(args.model, dtype=TORCH_DTYPES[args.dtype])
    ids = encode_prompt(loaded, document(0, min_chars=args.tokens * 4))[: args.tokens]
    kv, _ = prefill(loaded.model, ids)  # once
    path = os.path.join(args.dir or tempfile.mkdtemp(prefix="lynx-doc-"), "doc.lynx")
    save_cache(path, kv, prompt_token_ids=ids.tolist(), model_fingerprint=loaded.fingerprint)
    print(f"cached {len(ids)} tokens of documentation in {path} ({args.dtype})")

    answers = []
    for question in args.question or QUESTIONS:
        new = continuation_ids(loaded.tokenizer, ids.tolist(), question)
        load = open_progressive(path, link=link_at(args.bandwidth))
        try:
            res = run(loaded.model, load, RunConfig(max_new_tokens=args.max_new_tokens), new_token_ids=new,
                      fingerprint=loaded.fingerprint)
        finally:
            load.close()
        with open_cache(path) as cache, torch.no_grad():  # the same cache through transformers' generate
            out = loaded.model.generate(torch.tensor([ids.tolist() + new], device=loaded.model.device),
                                        cache=to_dynamic_cache(cache, loaded.model), do_sample=False,
                                        max_new_tokens=args.max_new_tokens)
        generated = out[0, len(ids) + len(new):].tolist()
        print(f"\n{question.strip()}\n  lynx: {loaded.tokenizer.decode(res.token_ids, skip_special_tokens=True)!r}"
              f" (drafted {res.stats.drafted}, kept {res.stats.accepted})"
              f"\n  generate: {loaded.tokenizer.decode(generated, skip_special_tokens=True)!r}")
        answers.append({"question": question, "new_token_ids": new, "token_ids": res.token_ids,
                        "draft_token_ids": res.stats.draft_token_ids, "generate_token_ids": generated})
    return answers


if __name__ == "__main__":
    main()
