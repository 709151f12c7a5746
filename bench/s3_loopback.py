"""An S3-compatible server on loopback for the benchmarks: moto's server mode in its own process,
so storage is remote-like (every read an HTTP request, no page cache), not the local disk.

:func:`loopback_s3` starts it, sets dummy credentials in the environment (the benchmark's rank
processes, spawned later, inherit them), creates a bucket and yields a :class:`LoopbackBucket`
whose :meth:`~LoopbackBucket.uri` gives LayerCheck store URIs in it; the server is killed at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Dummy credentials and region: moto accepts any, the AWS SDK needs some (and must not go looking
#: for a profile or the EC2 metadata service).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "bench-key",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
#: What ``layercheck bench --store`` accepts.
STORES = ("local", "s3-loopback")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    """``python -m moto.server`` on ``127.0.0.1:port``, once it accepts connections."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"moto server did not start on port {port}")


@dataclass(frozen=True)
class LoopbackBucket:
    port: int
    bucket: str

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def uri(self, prefix: str) -> str:
        """A store URI under ``prefix`` in the bucket."""
        return f"s3://{self.bucket}/{prefix}?endpoint_override={self.endpoint}&scheme=http"


@contextlib.contextmanager
def loopback_s3(bucket: str = "") -> Iterator[LoopbackBucket]:
    """A moto server on a free loopback port with a fresh bucket; credentials in ``os.environ``."""
    import pyarrow.fs as pafs

    os.environ.update(S3_ENV)
    port = free_port()
    server = start_moto(port)
    try:
        s3 = LoopbackBucket(port=port, bucket=bucket or f"layercheck-bench-{secrets.token_hex(4)}")
        pafs.S3FileSystem(endpoint_override=s3.endpoint, scheme="http", allow_bucket_creation=True).create_dir(
            s3.bucket
        )
        logger.info("S3-compatible store on loopback: moto at %s, bucket %s", s3.endpoint, s3.bucket)
        yield s3
    finally:
        server.kill()
        server.wait()
