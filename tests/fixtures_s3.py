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
