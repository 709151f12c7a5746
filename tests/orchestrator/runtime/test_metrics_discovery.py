"""Where a run's exporter binds and the file_sd file that names it."""

import json

from layercheck.orchestrator.core.run_config import MetricsConfig
from layercheck.orchestrator.runtime.metrics_discovery import bind_host, remove_discovery, write_discovery


def test_auto_binds_loopback_on_one_node_and_the_node_ip_on_a_cluster():
    assert MetricsConfig().host == "auto"
    assert bind_host("auto", alive_nodes=1) == "127.0.0.1"
    assert bind_host("auto", alive_nodes=3) == "node"
    assert bind_host("0.0.0.0", alive_nodes=3) == "0.0.0.0"  # an explicit address is kept


def test_the_discovery_file_names_the_endpoint_and_goes_with_the_run(tmp_path):
    path = write_discovery(str(tmp_path / "sd"), "run-1", "http://10.0.0.7:9464/metrics")
    assert json.loads(open(path).read()) == [{"targets": ["10.0.0.7:9464"], "labels": {}}]
    assert [p.name for p in (tmp_path / "sd").iterdir()] == ["run-1.json"]  # no temporary left
    remove_discovery(path)
    remove_discovery(path)  # twice: no error
    assert not list((tmp_path / "sd").iterdir())


def test_an_unwritable_directory_is_logged_not_fatal(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert write_discovery(str(blocker / "sd"), "run-1", "http://127.0.0.1:9464/metrics") is None
