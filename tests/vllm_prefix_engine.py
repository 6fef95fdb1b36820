"""One vLLM (CPU build) generation through LMCacheMPConnector, for tests/test_vllm_lmcache.py.

    python vllm_prefix_engine.py MODEL_DIR LMCACHE_PORT OUT.json

Greedy, 16 tokens, from a fixed 600-token prompt (two full 256-token LMCache chunks); writes the output token ids.
vLLM's engine core starts processes with spawn, hence the ``__main__`` guard."""

import json
import os
import sys

PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(600)]


def main() -> None:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ktc = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                           kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port})
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=32, max_model_len=1024, kv_transfer_config=ktc,
              enforce_eager=True, dtype="float32", max_num_seqs=1, gpu_memory_utilization=0.05)
    res = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                       SamplingParams(max_tokens=16, temperature=0.0, detokenize=False))
    with open(out, "w") as f:
        json.dump({"tokens": list(res[0].outputs[0].token_ids)}, f)


if __name__ == "__main__":
    main()
