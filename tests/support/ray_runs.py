"""Runs of the demo config on a local Ray in this process (``layercheck.orchestrator.runtime.driver.train``),
shortened for the tests."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from layercheck.orchestrator.core.run_config import RunConfig, load_run_config


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
