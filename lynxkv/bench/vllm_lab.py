"""Two vLLM instances and ``lynxkv vllm-proxy`` across the network lab: what tests/test_vllm_proxy.py and
benchmarks/bench_vllm.py run. Needs vLLM's CPU build (``make test-vllm`` makes its venv) and root.

The prefill instance (``LynxConnector``, kv_producer) runs in the lab's server namespace and serves its store at
``server_addr:STORE_PORT`` with the anchor marked EF and the residual CS1; the decode instance (kv_consumer) and the
proxy run in the client namespace, so every byte of KV crosses the shaped link, anchor first::

    with VllmLab(model_dir, tmp, rate="60Mbit") as vl:
        replies = vl.send([{"prompt": ids, "max_tokens": 64, "temperature": 0}])
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lynxkv.bench.netlab import NetLab

PREFILL_PORT, DECODE_PORT, PROXY_PORT, STORE_PORT = 8100, 8200, 8300, 7071
ROOT = Path(__file__).resolve().parents[2]


class EngineDied(RuntimeError):
    pass


class VllmLab:
    """See the module docstring. ``served_model`` is the name the instances serve the model under."""

    def __init__(self, model_dir, work, *, rate: str = "60Mbit", dtype: str = "float32", max_model_len: int = 4096,
                 timeout_s: float = 30.0, kv_space_gib: int = 1, up_timeout: float = 900.0):
        self.model_dir, self.work = str(model_dir), Path(work)
        self.rate, self.dtype, self.max_model_len = rate, dtype, max_model_len
        self.timeout_s, self.up_timeout = timeout_s, up_timeout
        self.store = self.work / "store"
        self.env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.served_model = "lynx-model"
        self.lab: NetLab | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    # -- lifecycle
    def __enter__(self) -> "VllmLab":
        self.lab = NetLab(rate=self.rate).__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
            self.lab = None
        for log in self._logs:
            log.close()

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _popen(self, name: str, side: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w")
        self._logs.append(log)
        proc = self.lab.popen(side, argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = proc
        return proc

    def _engine(self, name: str, side: str, port: int, role: str, extra: dict) -> None:
        ktc = {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynxkv.integrations.vllm.connector",
               "kv_role": role, "kv_connector_extra_config": extra}
        host = self.lab.server_addr if side == "server" else "127.0.0.1"
        self._popen(name, side, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                 self.model_dir, "--served-model-name", self.served_model, "--host", host, "--port",
                                 str(port), "--enforce-eager", "--dtype", self.dtype, "--block-size", "32",
                                 "--max-model-len", str(self.max_model_len), "--max-num-seqs", "16",
                                 "--kv-transfer-config", json.dumps(ktc)])

    def _start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self._engine("prefill", "server", PREFILL_PORT, "kv_producer",
                     {"store": str(self.store), "host": self.lab.server_addr, "port": STORE_PORT,
                      "dscp_anchor": "EF", "dscp_residual": "CS1"})
        self._engine("decode", "client", DECODE_PORT, "kv_consumer",
                     {"timeout_s": self.timeout_s, "sources": [f"http://{self.lab.server_addr}:{STORE_PORT}/"]})
        self.wait_up("server", f"{self.prefill_url}/health")
        self.wait_up("client", f"{self.decode_url}/health")
        self._popen("proxy", "client", [sys.executable, "-m", "lynxkv", "vllm-proxy", "--prefill", self.prefill_url,
                                        "--decode", self.decode_url, "--port", str(PROXY_PORT), "--timeout", "300"])
        self.wait_up("client", f"{self.proxy_url}/health")

    def wait_up(self, side: str, url: str) -> None:
        probe = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2)"
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.up_timeout:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise EngineDied(f"{name} exited ({p.returncode}):\n{self.log_tail(name)}")
            if self.lab.run(side, [sys.executable, "-c", probe], check=False, timeout=10).returncode == 0:
                return
            time.sleep(2)
        raise EngineDied(f"{url} did not come up in {self.up_timeout:g} s")

    # -- addresses
    @property
    def prefill_url(self) -> str:
        return f"http://{self.lab.server_addr}:{PREFILL_PORT}"

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{DECODE_PORT}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{PROXY_PORT}"

    # -- requests
    def send(self, bodies: list[dict], url: str | None = None, timeout: float = 900.0) -> list[dict]:
        """``bodies`` sent at once from the client namespace (to the proxy unless ``url``); each reply is
        ``{"status", "body", "seconds"}``."""
        path = self.work / f"requests-{time.monotonic_ns()}.json"
        path.write_text(json.dumps([{"model": self.served_model, **b} for b in bodies]))
        try:
            p = self.lab.run("client", [sys.executable, "-m", "lynxkv.bench.completions", url or self.proxy_url,
                                        str(path)], timeout=timeout, env=self.env)
        finally:
            path.unlink()
        return json.loads(p.stdout)

    def rss_bytes(self, name: str) -> int:
        """Resident memory of an instance's processes (the server and its engine and worker children)."""
        pids, total = [self.procs[name].pid], 0
        while pids:
            pid = pids.pop()
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    pids += [int(c) for c in f.read().split()]
            except (OSError, StopIteration):
                continue
        return total
