"""Runs of the demo config on a local Ray in this process (``layercheck.orchestrator.runtime.driver.train``),
shortened for the tests, and the runs several test modules read (session fixtures in
tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.run_config import RunConfig, load_run_config
from layercheck.policies.configs import IntervalConfig, LayerCheckConfig


def device_overrides() -> dict[str, Any]:
    """``LAYERCHECK_E2E_OVERRIDES``: a JSON object of run-config keys (e.g. ``{"cluster.use_gpu":
    true, "engine.precision": "bf16"}``) for every in-process Ray run; ``scripts/gpu_checks.sh``
    runs the end-to-end tests with NCCL and bf16 that way. Empty on CPU."""
    raw = os.environ.get("LAYERCHECK_E2E_OVERRIDES", "")
    return json.loads(raw) if raw else {}


def demo_config(tmp_path: Path, name: str, *, steps: int = 12, policy: Any = None, **overrides: Any) -> RunConfig:
    """examples/demo.toml, ``steps`` long (the schedule too, 2 warm-up steps), storing under
    ``tmp_path / name``, no metrics endpoint, with the device overrides and then ``overrides``;
    ``policy`` (a policy config) replaces the demo's."""
    config = load_run_config(
        "examples/demo.toml",
        {
            "name": name,
            "storage": str(tmp_path / name),
            "steps": steps,
            "optim.total_steps": steps,
            "optim.warmup_steps": 2,
            "metrics.port": 0,
            **device_overrides(),
            **overrides,
        },
    )
    return dataclasses.replace(config, policy=policy) if policy is not None else config


def private_ray_tmp() -> Path:
    """A new folder for a ``RAY_TMPDIR`` of a Ray's own: its sessions and the address file that a
    bare ``ray.init()`` on this machine joins stay apart from every other Ray's. Short, under
    /tmp: Ray's socket paths must fit in 107 bytes. The caller removes it."""
    return Path(tempfile.mkdtemp(prefix="lcray-", dir="/tmp"))


_OURS = {"ray": False}


def ensure_local_ray() -> None:
    """A local Ray in this process, as ``layercheck train`` starts it for the demo config (with the
    device overrides), its processes with the test fault injector (``tests/support/faults.py``:
    nothing fails outside ``injected``); kept until a test that does not ask for ``local_ray``
    comes next (tests/conftest.py), so adjacent tests share it."""
    import ray

    from layercheck.orchestrator.runtime.cluster import connect
    from tests.support.faults import faults_env

    if not ray.is_initialized():
        with faults_env():
            connect(load_run_config("examples/demo.toml", device_overrides()))
        _OURS["ray"] = True


def release_local_ray() -> None:
    """Shut down the local Ray :func:`ensure_local_ray` started, if it is up."""
    import ray

    if _OURS["ray"]:
        _OURS["ray"] = False
        if ray.is_initialized():
            ray.shutdown()


def train_demo(tmp_path: Path, name: str, *, policy: Any = None, resume: bool = False, **overrides: Any) -> Any:
    """:func:`demo_config`'s run, trained here on the local Ray; its result, which must have no error."""
    from layercheck.orchestrator.runtime.driver import train

    ensure_local_ray()
    result = train(demo_config(tmp_path, name, policy=policy, **overrides), resume=resume)
    assert result.error is None, result.error
    return result


EVERY_STEP = IntervalConfig(interval=1)
UNBOUNDED = {"persistence.max_versions_in_flight": 64}  # no layer held back waiting for a commit
#: The paper's policy, with a base at step 3 and thresholds that the demo's drift crosses.
LAYERCHECK = LayerCheckConfig(warmup_steps=3, smax=4, k0=0.05, k0_embed=0.05)
KILL_AT = 8
STEPS = 12
"""The shared runs' length (the demo's, shortened)."""


def clean_run(root: Path) -> Any:
    """The demo's ``STEPS`` steps without a failure, every layer persisted after every step (nothing held
    back): the failure-free reference state and losses, and a store whose final composite is
    the trained model."""
    overrides = {"steps": STEPS, "optim.total_steps": STEPS, "fault.kill_at_step": 0, "log_every": 4, **UNBOUNDED}
    return train_demo(root, "clean", policy=EVERY_STEP, **overrides)


def layercheck_run(root: Path) -> tuple[Any, Any, str]:
    """The demo's ``STEPS`` steps under the ``layercheck`` policy (``LAYERCHECK``), rank 1 SIGKILLed after
    step ``KILL_AT``, its metrics scraped every second by a real Prometheus (started first, on
    the run's discovery directory): ``(result, prometheus or None, why there is none)``."""
    from tests.support.prometheus import Prometheus, PrometheusUnavailable

    discovery = root / "sd"
    try:
        prometheus, missing = Prometheus(root, discovery), ""
    except PrometheusUnavailable as error:
        prometheus, missing = None, str(error)
    metrics = {"metrics.port": 0}
    if prometheus is not None:
        from layercheck.workers.env import free_port

        metrics = {"metrics.port": free_port(), "metrics.host": "auto", "metrics.discovery_dir": str(discovery)}
    try:
        overrides = {"steps": STEPS, "optim.total_steps": STEPS, "fault.kill_at_step": KILL_AT, **metrics}
        result = train_demo(root, "layercheck", policy=LAYERCHECK, **overrides)
        if prometheus is not None:
            prometheus.at = time.time()  # the run's final values are scraped: read them as of now
    except BaseException:
        if prometheus is not None:
            prometheus.stop()
        raise
    return result, prometheus, missing
