"""Shared fixtures: a loopback S3-compatible server (moto) behind a proxy a test can cut; a
private temporary directory for the local Ray of a `layercheck train` subprocess; a local Ray in
this process for the tests that call ``train()``; an empty layer store."""

import shutil
import tempfile
from pathlib import Path

import pytest

from layercheck.orchestrator.store.layer_store import LayerStore
from tests.support.ray_runs import device_overrides
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


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray in this process, as ``layercheck train`` starts it for the demo config (with
    the device overrides), for one test module; shut down after it."""
    import ray

    from layercheck.orchestrator.core.run_config import load_run_config
    from layercheck.orchestrator.runtime.cluster import connect

    connect(load_run_config("examples/demo.toml", device_overrides()))
    yield
    ray.shutdown()


@pytest.fixture
def store(tmp_path) -> LayerStore:
    """An empty layer store in the test's temporary directory."""
    return LayerStore.open(str(tmp_path / "store"))
