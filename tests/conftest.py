"""Shared fixtures: a loopback S3-compatible server (moto) behind a proxy a test can cut; a
private temporary directory for the local Ray of a `layercheck train` subprocess."""

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.s3_server import S3_ENV, LoopbackS3, new_bucket, start_moto


@pytest.fixture(scope="session")
def moto_server():
    """moto's server on a free loopback port, once per session; yields its (host, port)."""
    server, target = start_moto()
    yield target
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch) -> LoopbackS3:
    """A fresh bucket on the loopback S3 server, reached through a proxy the test can cut; dummy
    credentials and region in the environment (subprocesses started by the test inherit them)."""
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    bucket = new_bucket(moto_server)
    yield bucket
    bucket.proxy.close()


@pytest.fixture
def ray_tmp():
    """A private ``RAY_TMPDIR`` (short: Ray's socket paths must fit in 107 bytes), removed after."""
    path = Path(tempfile.mkdtemp(prefix="lcray-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
