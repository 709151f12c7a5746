"""Which Ray the driver joins: a cluster Ray's address file names only while it answers. A
`ray start` that crashed or was killed leaves its file behind, and joining it would retry for
minutes and fail (seen here: a stale /tmp/ray/ray_current_cluster stopped every run)."""

import os
import socket

import ray._private.services as services

from layercheck.orchestrator.runtime.cluster import _local_cluster


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_a_stale_address_file_is_ignored_with_a_warning(monkeypatch, caplog):
    stale = f"127.0.0.1:{closed_port()}"
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: stale)
    assert _local_cluster() is None
    assert stale in caplog.text and "does not answer" in caplog.text


def test_a_live_cluster_is_joined(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: live)
        assert _local_cluster() == live


def test_no_address_file_means_a_local_ray(monkeypatch):
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    assert _local_cluster() is None


def test_the_local_ray_starts_lean_unless_the_dashboard_is_asked_for(monkeypatch):
    """The local Ray LayerCheck starts runs without Ray's dashboard (``cluster.ray_dashboard``),
    without Ray Train's preemption watcher (nothing drains a local node; a user's own setting of
    the watcher stands) and without a job runtime_env."""
    import ray

    from layercheck.orchestrator.core.run_config import load_run_config
    from layercheck.orchestrator.runtime import cluster

    started = []
    during = []  # the workers' environment, which the local Ray's processes inherit from this one
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(
        ray, "init", lambda **kwargs: (started.append(kwargs), during.append(os.environ.get("DS_ACCELERATOR")))
    )
    monkeypatch.setattr(cluster, "_local_cluster", lambda: None)
    monkeypatch.setattr(cluster.ray_noise, "install", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(cluster.PREEMPTION_WATCHER_ENV, raising=False)

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cluster.connect(load_run_config("examples/demo.toml"))
    assert started[-1]["address"] == "local" and started[-1]["include_dashboard"] is False
    assert os.environ[cluster.PREEMPTION_WATCHER_ENV] == "0"
    # no job runtime_env (with one, every actor and worker starts cold): the workers' environment
    # is this process's while Ray starts, and this process's own again after
    assert "runtime_env" not in started[-1] and during[-1] == "cpu" and "DS_ACCELERATOR" not in os.environ

    monkeypatch.setenv(cluster.PREEMPTION_WATCHER_ENV, "1")
    cluster.connect(load_run_config("examples/demo.toml", {"cluster.ray_dashboard": True}))
    assert started[-1]["include_dashboard"] is True
    assert os.environ[cluster.PREEMPTION_WATCHER_ENV] == "1"
