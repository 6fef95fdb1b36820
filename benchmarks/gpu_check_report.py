"""The report of ``benchmarks/gpu_check.sh``: every step's status (from its ``NAME.status``: exit code, seconds,
limit) and result (``NAME.json``, the kernel tests' JUnit XML) gathered into ``gpu_check.json`` and a Markdown
summary, ``gpu_check.md``. A step is ``ok`` (exit 0), ``failed``, ``timeout`` (stopped at its limit: what it
wrote so far is kept), ``skipped`` (no budget left) or ``not run``."""

from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET

STEPS = ("env", "codec", "user_path", "runner", "kernels")


def _status(rc: int) -> str:
    return {0: "ok", 124: "timeout", 137: "timeout", -1: "skipped"}.get(rc, "failed")


def _tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-chars:]
    except OSError:
        return ""


def _step(steps_dir: str, name: str) -> dict:
    entry: dict = {"status": "not run"}
    try:
        with open(os.path.join(steps_dir, f"{name}.status")) as fh:
            rc, seconds, limit = (int(v) for v in fh.read().split())
        entry = {"status": _status(rc), "rc": rc, "seconds": seconds, "limit_s": limit}
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(steps_dir, f"{name}.json")) as fh:
            entry["result"] = json.load(fh)
    except (OSError, ValueError):
        pass
    if name == "kernels":
        try:
            suite = ET.parse(os.path.join(steps_dir, "kernels.xml")).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            entry["result"] = counts
            if entry["status"] == "ok" and counts["tests"] - counts["skipped"] == 0:
                entry["status"] = "failed"  # nothing ran: no device, or the selection matched nothing
        except (OSError, ET.ParseError, AttributeError):
            pass
    if entry["status"] != "ok":
        entry["log_tail"] = _tail(os.path.join(steps_dir, f"{name}.log"))
    return entry


def _fmt(v, unit: float = 1.0, digits: int = 3) -> str:
    return "–" if v is None else f"{v * unit:.{digits}f}"


def _markdown(rep: dict) -> list[str]:
    steps = rep["steps"]
    env = steps["env"].get("result", {})
    lines = [f"# lynxkv GPU check{' (dry run on the CPU: toy sizes, timings mean nothing)' if rep['dry'] else ''}",
             "", f"{rep['date']} · {env.get('card', '?')} · torch {env.get('torch', '?')} · "
             f"triton {env.get('imports', {}).get('triton', '?')} · transformers "
             f"{env.get('imports', {}).get('transformers', '?')}", "",
             "| step | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {n} | {s['status']} | {s.get('seconds', '–')} | {s.get('limit_s', '–')} |" for n, s in steps.items()]
    k = steps["kernels"].get("result")
    if k:
        lines += ["", f"Kernel tests: {k['tests']} collected, {k['failures']} failed, {k['errors']} errors, "
                      f"{k['skipped']} skipped."]
    codec = steps["codec"].get("result", {})
    if codec.get("rows"):
        lines += ["", "## Encode and decode against a device copy", "",
                  "| tokens | operation | ms | BF16 GB/s | traffic vs copy |", "|---|---|---|---|---|"]
        lines += [f"| {r['tokens']} | {r['op']} | {_fmt(r['ms'])} | {_fmt(r['bf16_GBps'], 1, 0)} | "
                  f"{_fmt(r['traffic_vs_copy'], 100, 0) + '%' if r['traffic_vs_copy'] is not None else '–'} |"
                  for r in codec["rows"]]
    user = steps["user_path"].get("result", {})
    if user.get("runs"):
        lines += ["", "## save_cache / load_kv(device) against safetensors + .to(device) (seconds, median)", "",
                  "| tokens | BF16 GB | save | load full | load anchor | safetensors save | safetensors load + copy |"
                  " full rel. error | ok |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['tokens']} | {_fmt(r['bf16_bytes'], 1e-9)} | {_fmt(r['save_s'])} | {_fmt(r['load_full_s'])} "
                  f"| {_fmt(r['load_anchor_s'])} | {_fmt(r['safetensors_save_s'])} | "
                  f"{_fmt(r['safetensors_load_to_device_s'])} | {r['full_rel_error']:.1e} | {r['ok']} |"
                  for r in user["runs"]]
    lines += _runner_lines(steps["runner"].get("result", {}))
    lines += ["", f"Tokens identical to plain decoding: {rep['tokens_identical']}. All steps ok: {rep['ok']}."]
    for name, s in steps.items():
        if s.get("log_tail"):
            lines += ["", f"### {name}: {s['status']} (end of its log)", "", "```", s["log_tail"].rstrip(), "```"]
    return lines


def _runner_lines(runner: dict) -> list[str]:
    if not runner.get("runs"):
        return []
    n = runner.get("new_tokens", 64)
    lines = ["", f"## Speculative runner ({runner.get('model_parameters', 0) / 1e9:.2f} B random-weight parameters, "
                 f"{runner.get('dtype')}): Lynx against the monolithic full code (seconds)", "",
             f"| tokens | Gbit/s | residual due | TT1 Lynx | TT1 mono | TT{n} Lynx | TT{n} mono | draft step | "
             "decode step | drafted / accepted | identical | peak GiB | KV GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in runner["runs"]:
        peak = length.get("peak_device_bytes")
        kv = length.get("kv_bytes")
        if "error" in length:
            lines.append(f"| {length['tokens']} | – | error: {length['error'][:120]} |")
        for r in length.get("rates", []):
            ly, mo = r.get("lynx", {}), r.get("monolithic", {})
            lines.append(
                f"| {length['tokens']} | {r['gbits']:g} | {_fmt(r['residual_due_s'])} | {_fmt(ly.get('tt1_s'))} | "
                f"{_fmt(mo.get('tt1_s'))} | {_fmt(ly.get(f'tt{n}_s'))} | {_fmt(mo.get(f'tt{n}_s'))} | "
                f"{_fmt(ly.get('draft_step_s'), 1e3, 1)} ms | {_fmt(mo.get('decode_step_s'), 1e3, 1)} ms | "
                f"{ly.get('drafted', '–')} / {ly.get('accepted', '–')} | "
                f"{r.get('tokens_identical', 'error: ' + r.get('error', '?')[:80])} | "
                f"{_fmt(peak, 2**-30, 1) if peak else '–'} | {_fmt(kv, 2**-30, 2) if kv else '–'} |")
    cli = runner.get("cli")
    if cli:
        lines += ["", f"The command users run, in a process of its own: `{cli.get('command', 'lynxkv run')}`: "
                      + (f"tokens identical to plain decoding: {cli.get('identical')}, verified {cli.get('verified')}; "
                         f"process {_fmt(cli.get('process_s'), 1, 1)} s (imports and model load included), TT1 "
                         f"{_fmt(cli.get('tt1_s'))} s, TT{n} {_fmt(cli.get(f'tt{n}_s'))} s, drafted / accepted "
                         f"{cli.get('drafted', '–')} / {cli.get('accepted', '–')}"
                         if "error" not in cli else f"error: {cli['error'][:300]}")]
    return lines


def report(steps_dir: str, json_path: str | None, md_path: str | None, dry: bool) -> int:
    """Write the JSON and Markdown reports; 0 when every step is ok and every run's tokens are identical."""
    steps = {name: _step(steps_dir, name) for name in STEPS}
    rows = [r for length in steps["runner"].get("result", {}).get("runs", []) for r in length.get("rates", [])]
    identical = bool(rows) and all(r.get("tokens_identical") is True for r in rows)
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry": dry, "steps": steps,
           "tokens_identical": identical, "ok": identical and all(s["status"] == "ok" for s in steps.values())}
    text = "\n".join(_markdown(rep)) + "\n"
    for path, data in ((json_path, json.dumps(rep, indent=2, default=str)), (md_path, text)):
        if path:
            with open(path + ".tmp", "w") as fh:
                fh.write(data)
            os.replace(path + ".tmp", path)
    print(text)
    return 0 if rep["ok"] else 1
