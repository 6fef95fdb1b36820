"""A real S3-compatible HTTP server on loopback (moto's standalone server), started and stopped by the fixture.

Tests reach it through s3fs exactly as users reach AWS or MinIO: real HTTP requests, ranged GETs, PUTs. The
fixture also installs the endpoint in fsspec's configuration (``fsspec.config.conf["s3"]``) so that code which
is given nothing but an ``s3://`` URL finds it, and offers the same settings as environment variables
(``env``) for subprocesses. Skips cleanly when moto or s3fs is not installed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    storage_options: dict

    @property
    def env(self) -> dict:
        """Environment for a subprocess that must open ``s3://`` URLs on this server with no other setup."""
        e = dict(os.environ)
        e["FSSPEC_S3"] = json.dumps(self.storage_options)
        e.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        return e

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import logging

    import fsspec.config

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise

    old_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    old_conf = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = dict(options)
    srv = S3Server(endpoint=endpoint, bucket="lynx-tier", storage_options=options)
    srv.fs().call_s3("create_bucket", Bucket=srv.bucket)
    try:
        yield srv
    finally:
        if old_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = old_conf
        server.stop()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------------------ test caches


def _one_thread(fn):
    """Build test caches with one intra-op thread: packing many small tensors gains nothing from OpenMP and, on
    a busy shared machine, stalls on every fork/join (measured 13 s vs 0.5 s for the 40 MB cache)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapper


def random_kv(layers: int = 2, heads: int = 2, tokens: int = 600, dim: int = 16, seed: int = 0):
    """Per-layer (keys, values) [H, T, D] of random fp32 values (T not a multiple of the page on purpose)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, tokens, dim, generator=g), torch.randn(heads, tokens, dim, generator=g))
            for _ in range(layers)]


@_one_thread
def cache_bytes(kv=None, *, residual_location: str = "x.lynxr", single_file: bool = False,
                prompt_token_ids=(1, 2, 3), fingerprint: str = "0" * 32):
    """(anchor bytes, residual bytes or None) of a real quantized cache of ``kv``."""
    from lynxkv.cache import encode_kv
    from lynxkv.format import build_files

    enc = encode_kv(kv if kv is not None else random_kv(), prompt_token_ids=prompt_token_ids,
                    model_fingerprint=fingerprint)
    built = build_files(enc, single_file=single_file, residual_location="" if single_file else residual_location)
    return built.anchor, built.residual


@_one_thread
def synthetic_cache_bytes(layers: int, heads: int, tokens: int, dim: int, *, seed: int = 0,
                          residual_location: str = "x.lynxr"):
    """A valid 4+4 cache of random codes and metadata, built without running the quantizer (fast, any size)."""
    import torch

    from lynxkv.cache import EncodedCache
    from lynxkv.format import build_files
    from lynxkv.quant.reference import EncodedTensor
    from lynxkv.quant.scheme import LINEAR  # values per token, no sink tokens: every page alike

    g = torch.Generator().manual_seed(seed)
    nc = -(-tokens // LINEAR.chunk)

    def tensor():
        return EncodedTensor(
            anchor=torch.randint(0, 16, (heads, tokens, dim), dtype=torch.uint8, generator=g),
            residual=torch.randint(0, 16, (heads, tokens, dim), dtype=torch.uint8, generator=g),
            offset=torch.randn(heads, nc, dim, generator=g).half(),
            scale=torch.rand(heads, nc, dim, generator=g).half(),
        )

    enc = EncodedCache(LINEAR, [(tensor(), tensor()) for _ in range(layers)], heads, dim, tokens)
    built = build_files(enc, residual_location=residual_location)
    return built.anchor, built.residual


def write_pair(directory, anchor: bytes, residual: bytes | None, name: str = "x"):
    """Write ``name.lynx`` (+ ``name.lynxr``) into ``directory``; return the anchor path as a string."""
    import os

    a = os.path.join(str(directory), f"{name}.lynx")
    with open(a, "wb") as f:
        f.write(anchor)
    if residual is not None:
        with open(os.path.join(str(directory), f"{name}.lynxr"), "wb") as f:
            f.write(residual)
    return a


def kv_equal(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))
