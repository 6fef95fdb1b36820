"""Lynx inside vLLM across the network lab: ``lynxkv vllm-proxy`` in speculative mode against its full mode (plain
compressed P/D transfer) and against moving the BF16 KV over the same link, on held-out prompts.

    make .venv-vllm/bin/vllm
    .venv-vllm/bin/python benchmarks/bench_vllm.py --rate 60Mbps --prompts 3 --repeats 3

Needs root (the lab) and vLLM's CPU build. The model is SmolLM2-135M, the offline GGUF dequantized once into an
HF folder under ``--work`` (vLLM's CPU build reads it in fp32). The prompts are the held-out pieces of
``benchmarks/bench_held_out.py`` (the standard library's source, none sharing a 32-token run with the text the
defaults were chosen on), sent as token ids, 64 tokens each (no stop token), greedy.

One engine pair serves every request; each round sends, per prompt, one full-mode and one speculative request
(their order alternating between rounds), then fetches the BF16 KV of that prompt (the full code decoded to a
bf16 safetensors file, served by a plain HTTP server in the prefill's namespace) over the same link. Per prompt,
medians of the rounds with min-max:

- bytes on the wire: the lynx cache (anchor + residual) over the BF16 KV's size;
- TT1 and TT64 (the client's time to the whole 64-token reply) of full mode and speculative mode;
- the BF16 baseline's TT1, counted as prefill + the BF16 fetch (a lower bound: it leaves out loading it into the
  decode instance and its first step);
- drafted and kept drafts, the proxy's engine requests and its verify time;
- the decode instance's peak resident memory during each mode's requests;
- identical tokens between the modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

TOKENS_OUT = 64


def model_dir(work: Path) -> Path:
    """SmolLM2's offline GGUF, dequantized once into an HF folder vLLM reads."""
    out = work / "smollm2-hf"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lynxkv.hf.offline import smollm2_gguf

    folder, name = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights are dequantized: save them as plain tensors
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def prompts(model: Path, count: int, tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from lynxkv.eval.cases import choosing_runs, stdlib_text, text_cases

    tok = AutoTokenizer.from_pretrained(model)
    cases, _ = text_cases(tok, stdlib_text(), tokens, count, 0, avoid=choosing_runs(tok))
    return [ids.tolist() for ids, _ in cases]


class PeakRSS:
    """The highest resident memory of an instance while a block runs (sampled every 20 ms)."""

    def __init__(self, vl, name: str):
        self.vl, self.name, self.peak = vl, name, 0

    def __enter__(self):
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.vl.rss_bytes(self.name))
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def bf16_file(vl, url: str, serve_dir: Path) -> tuple[Path, int]:
    """The prompt's KV in BF16 (its full code decoded to safetensors), in the folder the plain HTTP server serves."""
    from lynxkv import open_cache
    from safetensors.torch import save_file
    import torch

    name = url.rsplit("/", 1)[1]
    out = serve_dir / (name[:-len(".lynx")] + ".safetensors")
    with open_cache(str(vl.store / name)) as c:
        kv = c.load_kv(dtype=torch.bfloat16)
    save_file({f"{i}.{kind}": t.contiguous() for i, (k, v) in enumerate(kv) for kind, t in (("k", k), ("v", v))},
              str(out))
    return out, sum(k.numel() + v.numel() for k, v in kv) * 2


def fetch_seconds(vl, url: str) -> float:
    code = ("import sys, time, urllib.request; t = time.perf_counter(); "
            "urllib.request.urlopen(sys.argv[1], timeout=600).read(); print(time.perf_counter() - t)")
    return float(vl.lab.run("client", [sys.executable, "-c", code, url], timeout=900).stdout)


def med(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="60Mbps")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="a folder for the model and the runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    from lynxkv.bench.netlab import can_create_lab
    from lynxkv.bench.vllm_lab import VllmLab

    if (reason := can_create_lab()) is not None:
        print(f"bench_vllm: {reason}", file=sys.stderr)
        return 2
    work = a.work or Path(tempfile.mkdtemp(prefix="lynx-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(work)
    ids = prompts(model, a.prompts, a.tokens)
    rows = {i: {"full": [], "spec": [], "bf16_tt1": [], "rss": {"full": 0, "spec": 0}} for i in range(len(ids))}
    with VllmLab(model, work / "run", rate=a.rate.replace("bps", "bit"), max_model_len=4096, timeout_s=120,
                 kv_space_gib=2) as vl:
        serve_dir = work / "run" / "bf16"
        serve_dir.mkdir(exist_ok=True)
        http = vl.lab.popen("server", [sys.executable, "-m", "http.server", "--bind", vl.lab.server_addr, "7072",
                                       "--directory", str(serve_dir)], stdout=None, stderr=None)
        vl.wait_up("server", f"http://{vl.lab.server_addr}:7072/")
        vl.send([{"prompt": ids[0][:64], "max_tokens": 2, "temperature": 0}])  # warm both engines
        for r in range(a.repeats):
            for i, prompt in enumerate(ids):
                order = ("full", "spec") if (r + i) % 2 == 0 else ("spec", "full")
                for mode in order:
                    body = {"prompt": prompt, "max_tokens": TOKENS_OUT, "temperature": 0, "ignore_eos": True}
                    if mode == "full":
                        body["lynx_mode"] = "full"
                    with PeakRSS(vl, "decode") as rss:
                        reply = vl.send([body])[0]
                    if reply["status"] != 200:
                        print(f"prompt {i + 1} {mode}: {reply['body']}", file=sys.stderr)
                        return 1
                    rows[i][mode].append(reply)
                    rows[i]["rss"][mode] = max(rows[i]["rss"][mode], rss.peak)
                url = rows[i]["full"][-1]["body"]["lynx"]["cache_url"]
                path, bf16 = bf16_file(vl, url, serve_dir)
                fetch = fetch_seconds(vl, f"http://{vl.lab.server_addr}:7072/{path.name}")
                rows[i]["bf16_tt1"].append(rows[i]["full"][-1]["body"]["lynx"]["prefill_s"] + fetch)
                name = url.rsplit("/", 1)[1]
                rows[i]["lynx_bytes"] = sum(f.stat().st_size for f in vl.store.glob(name[:-5] + ".lynx*"))
                rows[i]["bf16_bytes"] = bf16
                path.unlink()
        http.terminate()
    print(f"lynxkv vllm-proxy, SmolLM2-135M (fp32 in vLLM's CPU build), {len(ids)} held-out ~{a.tokens}-token "
          f"prompts, {TOKENS_OUT} tokens, {a.rate} lab link, medians of {a.repeats} interleaved rounds [min-max]")
    out = []
    for i, row in rows.items():
        full, spec = row["full"], row["spec"]
        tok = [x["body"]["choices"][0]["token_ids"] for x in full + spec]
        lynx = [x["body"]["lynx"] for x in spec]
        ftr = [x["body"]["lynx"] for x in full]
        tt64_ratio = [s["seconds"] / f["seconds"] for s, f in zip(spec, full)]
        doc = {"prompt": i + 1, "bytes_ratio": row["lynx_bytes"] / row["bf16_bytes"],
               "full_tt1": med([t["first_token_s"] for t in ftr]), "full_tt64": med([x["seconds"] for x in full]),
               "spec_tt1": med([t["first_token_s"] for t in lynx]), "spec_tt64": med([x["seconds"] for x in spec]),
               "bf16_tt1": med(row["bf16_tt1"]), "spec_over_full_tt64": med(tt64_ratio),
               "full_tt1_over_bf16_tt1": med([t["first_token_s"] / b for t, b in zip(ftr, row["bf16_tt1"])]),
               "drafted": med([t["drafted"] for t in lynx]), "kept": med([t["kept"] for t in lynx]),
               "engine_requests": med([t["engine_requests"] for t in lynx]),
               "verify_s": med([t["verify_s"] for t in lynx]),
               "decode_peak_rss_mib": {m: round(v / 2**20) for m, v in row["rss"].items()},
               "identical_tokens": all(t == tok[0] for t in tok)}
        out.append(doc)
        print(json.dumps(doc))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if all(d["identical_tokens"] for d in out) else 1


if __name__ == "__main__":
    sys.exit(main())
