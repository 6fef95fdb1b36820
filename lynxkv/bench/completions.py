"""OpenAI ``/v1/completions`` requests sent all at once, from inside a lab namespace: what tests/test_vllm_proxy.py
and benchmarks/bench_vllm.py send to ``lynxkv vllm-proxy`` or a vLLM instance. Standard library only.

    python -m lynxkv.bench.completions URL REQUESTS.json

``REQUESTS.json``: a list of request bodies, sent all at once (one thread each); prints one JSON list of
``{"status", "body", "seconds"}``, in order."""

import json
import sys
import threading
import time
import urllib.error
import urllib.request


def send(url: str, body: dict, out: list, i: int) -> None:
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    out[i] = {"status": status, "body": json.loads(raw), "seconds": time.perf_counter() - t0}


def main() -> None:
    url, bodies = sys.argv[1], json.load(open(sys.argv[2]))
    out: list = [None] * len(bodies)
    threads = [threading.Thread(target=send, args=(url, b, out, i)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
