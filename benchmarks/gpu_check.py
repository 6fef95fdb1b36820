"""The Python steps of ``benchmarks/gpu_check.sh``: the environment, the user path and the speculative runner on a
GPU (``--dry``: the same code at toy sizes on the CPU), and the report that gathers every step's result.

    python benchmarks/gpu_check.py env|user-path|runner [--dry] --json FILE
    python benchmarks/gpu_check.py report [--dry] --steps DIR --json FILE --markdown FILE

Every step writes its JSON as it goes (a step stopped by its time limit keeps what it measured) and exits non-zero
when a check fails (a load that does not round-trip, tokens that differ from plain decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GB = 1e9
KV_SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128}  # Llama-3-8B
DRY_KV_SHAPE = {"layers": 2, "kv_heads": 2, "head_dim": 16}
# The runner's model: Llama-3-8B's attention (32 layers, 8 KV heads x 128), narrower elsewhere (~1.5 B parameters)
MODEL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, vocab_size=32768)
DRY_MODEL = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, vocab_size=128)


class Setup:
    """Device, dtype, sizes and timing of one run: a CUDA GPU, or the CPU for ``--dry``."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.dtype = torch.float32 if dry else torch.bfloat16  # fp32 on the CPU: exact, and fast there
        self.shape = DRY_KV_SHAPE if dry else KV_SHAPE

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, repeats: int = 1) -> tuple[float, object]:
        """(median seconds over ``repeats`` calls, the last result), synchronized on the device."""
        times, out = [], None
        for _ in range(repeats):
            out = None  # the previous result's memory is free before the next call
            self.sync()
            t0 = time.perf_counter()
            out = fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None

    def kv(self, tokens: int, seed: int = 0, layers: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Synthetic KV-like per-layer (keys, values) ``[H, T, D]`` on the device (bench_gpu's statistics), of every
        layer of the shape or of the first ``layers``."""
        from bench_gpu import kv_like

        s = self.shape
        kv = []
        # a tensor each (safetensors refuses views of one storage), a layer at a time
        for i in range(layers or s["layers"]):
            x = kv_like(2, s["kv_heads"], tokens, s["head_dim"], str(self.device), seed * 1000 + i).to(self.dtype)
            kv.append((x[0].clone(), x[1].clone()))
        return kv


def write(path: str | None, result: dict) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        os.replace(tmp, path)


def cmd_env(args) -> int:
    """Versions, the card and the imports every step needs; fails without CUDA (unless ``--dry``)."""
    result = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
              "dry": args.dry, "imports": {}}
    for name in ("triton", "numpy", "safetensors", "transformers", "pytest", "lynxkv"):
        try:
            mod = __import__(name)
            result["imports"][name] = getattr(mod, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - every missing module is reported, not just the first
            result["imports"][name] = f"MISSING: {type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}")
    else:
        result["card"] = "CPU (dry run)" if args.dry else "NONE"
    import lynxkv
    from lynxkv.quant import fast

    result["lynxkv_from"] = os.path.dirname(lynxkv.__file__)  # the import root's link, not the checkout
    result["compiled_cpu_kernels"] = fast.available()
    print(json.dumps(result, indent=2))
    write(args.json, result)
    missing = [k for k, v in result["imports"].items() if str(v).startswith("MISSING")]
    return 1 if missing or not (args.dry or torch.cuda.is_available()) else 0


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.3f}s"


def _max_rel_error(got, want) -> float:
    return max(float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30))
               for pg, pw in zip(got, want) for g, w in zip(pg, pw))


def cmd_user_path(args) -> int:
    """save_cache of device tensors, load_kv(device=...) full and anchor-only, against safetensors save, load and
    copy to the device, at each token count; the loads checked against the input."""
    import lynxkv

    try:
        from safetensors.torch import load_file, save_file
    except ImportError:  # the baseline is left out; lynxkv's own path is still measured (env reports the gap)
        load_file = save_file = None

    st = Setup(args.dry)
    tokens = args.tokens or ([40, 300] if args.dry else [8192, 32768])
    result = {"device": str(st.device), "dtype": str(st.dtype), "shape": st.shape, "runs": []}
    ok = True
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for t in tokens:
            kv = st.kv(t)
            bf16_bytes = sum(x.numel() * x.element_size() for pair in kv for x in pair)
            path, st_path = os.path.join(tmp, f"c{t}.lynx"), os.path.join(tmp, f"c{t}.safetensors")
            def load(**options):
                with lynxkv.open_cache(path) as cache:
                    return cache.load_kv(device=st.device, **options)

            save_s, info = st.timed(lambda: lynxkv.save_cache(path, kv))
            load_s, full = st.timed(load, args.repeats)
            anchor_s, anchor = st.timed(lambda: load(anchor_only=True), args.repeats)
            on_device = all(x.device.type == st.device.type for pair in full + anchor for x in pair)
            full_err, anchor_err = _max_rel_error(full, kv), _max_rel_error(anchor, kv)
            del full, anchor
            st_save_s = st_load_s = None
            if save_file is not None:
                named = {f"{kind}{i}": x for i, pair in enumerate(kv) for kind, x in zip("KV", pair)}
                st_save_s, _ = st.timed(lambda: save_file(named, st_path))
                st_load_s, _ = st.timed(lambda: {k: v.to(st.device) for k, v in load_file(st_path).items()},
                                        args.repeats)
                del named
            run = {
                "tokens": t, "bf16_bytes": bf16_bytes, "anchor_file_bytes": info.anchor_bytes,
                "residual_file_bytes": info.residual_bytes,
                "safetensors_bytes": os.path.getsize(st_path) if os.path.exists(st_path) else None,
                "save_s": save_s, "load_full_s": load_s, "load_anchor_s": anchor_s,
                "safetensors_save_s": st_save_s, "safetensors_load_to_device_s": st_load_s,
                "full_rel_error": full_err, "anchor_rel_error": anchor_err, "on_device": on_device,
            }
            # a sanity bound, not the quantizer's error (docs/evaluation.md): on this synthetic KV the full code is
            # ~0.5% from the input and the anchor ~8%; a page decoded into the wrong place or not at all is ~100%
            run["ok"] = on_device and full_err < 0.02 and anchor_err < 0.2
            ok &= run["ok"]
            result["runs"].append(run)
            print(f"[user_path] {t} tokens: save {save_s:.3f}s load {load_s:.3f}s anchor {anchor_s:.3f}s | "
                  f"safetensors save {_s(st_save_s)} load+to({st.device.type}) {_s(st_load_s)} | "
                  f"rel.err full {full_err:.2e} anchor {anchor_err:.2e} on device {on_device}", flush=True)
            write(args.json, result)
            del kv
            if os.path.exists(st_path):
                os.remove(st_path)
    return 0 if ok else 1


def build_model(st: Setup, layers: int | None = None):
    """A random-weight Llama-shaped causal LM on the device, in the run's dtype (built there: no host copy), with
    every layer of the shape or the first ``layers``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = st.shape
    cfg = LlamaConfig(**(DRY_MODEL if st.dry else MODEL), num_hidden_layers=layers or s["layers"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], max_position_embeddings=65536 + 128)
    torch.manual_seed(0)
    with torch.device(st.device):
        model = LlamaForCausalLM(cfg).to(st.dtype).eval()
    return model


def cmd_runner(args) -> int:
    """The speculative runner against the monolithic full code and plain decoding, per token count and link."""
    from runner_check import measure_runner

    return measure_runner(Setup(args.dry), build_model, args, write)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["env", "user-path", "runner", "report"])
    ap.add_argument("--dry", action="store_true", help="toy sizes on the CPU (checks the script, measures nothing)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--steps", default=None, help="report: the directory of the steps' results")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--gbits", type=float, nargs="+", default=None, help="runner: emulated link rates, Gbit/s")
    ap.add_argument("--new-tokens", type=int, default=None, help="runner: tokens per run (default 64; dry 24)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None, help="where the user path writes its caches (default: the system's)")
    args = ap.parse_args(argv)
    if args.command == "report":
        from gpu_check_report import report

        return report(args.steps, args.json, args.markdown, args.dry)
    return {"env": cmd_env, "user-path": cmd_user_path, "runner": cmd_runner}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
