"""Which Ray the driver joins: a cluster Ray's address file names only while it answers. A
`ray start` that crashed or was killed leaves its file behind, and joining it would retry for
minutes and fail (seen here: a stale /tmp/ray/ray_current_cluster stopped every run)."""

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
