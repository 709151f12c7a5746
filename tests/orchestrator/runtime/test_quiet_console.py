"""A quiet console: the run's Ray processes start with Ray Train's print patch off unless the
user set it, and the metrics discovery folder cannot shadow ``import layercheck`` from the
system's temp directory."""

import os
import subprocess
import sys

from layercheck.orchestrator.core.run_config import MetricsConfig
from layercheck.orchestrator.runtime.cluster import PRINT_PATCH_ENV, worker_env


def test_the_print_patch_is_off_unless_the_user_sets_it():
    assert worker_env(use_gpu=False, environ={})[PRINT_PATCH_ENV] == "0"
    assert worker_env(use_gpu=False, environ={PRINT_PATCH_ENV: "1"})[PRINT_PATCH_ENV] == "1"
    assert worker_env(use_gpu=False, environ={})["DS_ACCELERATOR"] == "cpu"
    assert "DS_ACCELERATOR" not in worker_env(use_gpu=True, environ={})


def test_the_metrics_folder_cannot_shadow_the_package(tmp_path):
    top = MetricsConfig().discovery_dir.strip("/").split("/")[1]  # the folder made under /tmp
    assert not top.isidentifier(), f"/tmp/{top} would be importable as a package"
    (tmp_path / top / "prometheus").mkdir(parents=True)
    code = "import layercheck; print(layercheck.attach.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and out.stdout.strip() == "attach", out.stderr
