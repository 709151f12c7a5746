"""cluster.yaml: valid for Ray's cluster launcher, and what a booted node needs to run LayerCheck
(the Ray version we test with, Python >= 3.10, a pinned CUDA torch, the project, GPU workers,
the metrics port open), with the run config it points to on object storage."""

import re
from pathlib import Path

import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from layercheck.orchestrator.core.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_ray_accepts_it():
    # with Ray's defaults filled in, against Ray's own JSON schema (ray/autoscaler/ray-schema.json)
    validate_config(prepare_config(CLUSTER))


def test_the_image_is_the_ray_and_python_we_test_with():
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-gpu", CLUSTER["docker"]["image"])
    assert match, CLUSTER["docker"]["image"]
    assert match.group(1) == ray.__version__
    assert int(match.group(2)) >= 10


def test_setup_installs_a_pinned_cuda_torch_and_the_project():
    setup = CLUSTER["setup_commands"]
    (torch,) = [c for c in setup if " torch" in c]
    assert re.search(r"torch==\d+\.\d+\.\d+", torch) and "download.pytorch.org/whl/cu" in torch
    assert any("pip install" in c and "~/layercheck" in c for c in setup)
    assert CLUSTER["file_mounts"]["~/layercheck"] == "."


def test_gpu_workers_and_the_metrics_port_open():
    workers = CLUSTER["available_node_types"]["gpu_worker"]
    assert workers["min_workers"] >= 2 and workers["node_config"]["InstanceType"].startswith(("g", "p"))
    run = load_run_config(ROOT / "examples" / "cluster.toml")
    ports = {p["FromPort"] for p in CLUSTER["provider"]["security_group"]["IpPermissions"]}
    assert run.metrics.port in ports


def test_the_run_config_it_points_to_uses_object_storage_and_gpus():
    assert "examples/cluster.toml" in (ROOT / "cluster.yaml").read_text()
    run = load_run_config(ROOT / "examples" / "cluster.toml")
    assert run.storage_uri.startswith("s3://")
    assert run.cluster.use_gpu and 0 < run.cluster.min_workers < run.cluster.num_workers
    assert run.metrics.host == "auto"
