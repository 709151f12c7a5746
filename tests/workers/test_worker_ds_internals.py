"""Each private-DeepSpeed wrapper in workers/engines/ds_internals.py, checked against public helpers.

If a DeepSpeed upgrade moves an attribute, these tests say which wrapper broke.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib

from layercheck.workers.engines import ds_internals
from tests.support import worker_jobs
from tests.support.dist_harness import run_jobs


def test_missing_attribute_is_a_loud_named_error():
    class Engine:
        pass

    with pytest.raises(ds_internals.DeepSpeedInternalsError, match="basic_optimizer"):
        ds_internals.client_optimizer(Engine())


def test_installed_deepspeed_is_one_the_wrappers_were_verified_against():
    installed = importlib.metadata.version("deepspeed")
    assert ds_internals.deepspeed_is_verified(installed), (
        f"DeepSpeed {installed} is installed, but workers/engines/ds_internals.py was verified against "
        f"{ds_internals.VERIFIED_DEEPSPEED}: run the slow tests of this file against it, fix what moved, "
        "then widen VERIFIED_DEEPSPEED and the pin in pyproject.toml together"
    )


def test_pyproject_pins_the_verified_range():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if re.match(r"deepspeed\b", d)]
    assert pin.replace(" ", "") == "deepspeed" + ds_internals.VERIFIED_DEEPSPEED


@pytest.mark.parametrize(
    "version, verified",
    [
        ("0.19.8", True),
        ("0.19.12", True),
        ("0.19.7", False),
        ("0.20.0", False),
        ("0.20.0rc1", False),
        ("1.0", False),
        ("0.19.9.dev0", False),
        ("not-a-version", False),
    ],
)
def test_verified_range(version, verified):
    assert ds_internals.deepspeed_is_verified(version) is verified


def test_an_unverified_deepspeed_is_refused_unless_the_user_opts_in(monkeypatch, caplog):
    monkeypatch.delenv(ds_internals.ALLOW_UNVERIFIED_ENV, raising=False)
    ds_internals.check_deepspeed_version("0.19.8")
    with pytest.raises(
        ds_internals.DeepSpeedInternalsError, match=r"DeepSpeed 0\.21\.0 .*" + ds_internals.ALLOW_UNVERIFIED_ENV
    ):
        ds_internals.check_deepspeed_version("0.21.0")
    monkeypatch.setenv(ds_internals.ALLOW_UNVERIFIED_ENV, "1")
    with caplog.at_level(logging.ERROR, logger="layercheck.workers.engines.ds_internals"):
        ds_internals.check_deepspeed_version("0.21.0")
    assert "DeepSpeed 0.21.0 is outside" in caplog.text


WRAPPED = [(0, "bf16"), (2, "bf16"), (3, "bf16")]


@pytest.fixture(scope="module")
def internals():
    """Every stage's job, one after another in one 2-rank spawn."""
    return dict(zip(WRAPPED, run_jobs(2, [(worker_jobs.internals_job, config) for config in WRAPPED])))


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", WRAPPED)
def test_wrappers_agree_with_deepspeed(internals, stage, precision):
    results = internals[stage, precision]
    for r in results:
        assert r["client_is_drift_adamw"]
        assert r["refresh_reaches_model"]
        if stage == 0:
            assert r["pairs_cover_params"] and r["masters_match_model"] and r["masters_are_fp32"]
        else:
            assert r["fragment_values_match_public_helper"]
    if stage:
        for name, numel in results[0]["numel"].items():
            assert sum(r["coverage"][name] for r in results) == numel, name
    if stage == 3:
        assert all(r["sub_groups_cover_groups"] for r in results)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_an_engine_build_never_imports_torchs_inductor_and_a_warm_spares_imports_nothing_of_muon(warm):
    """Building a ZeRO-3 engine imports DeepSpeed's Muon optimizer (its wrappers check for it),
    whose kernels are wrapped in ``torch.compile`` at import: LayerCheck imports it with the
    wrapping deferred, so no build imports torch's inductor (about 2 s of CPU per worker start).
    ``warm_engine_imports`` (what a warm spare runs while it waits) leaves even the Muon import
    out of a promoted spare's build (``warm``). A DeepSpeed that moves those imports fails here."""
    import subprocess
    import sys

    code = f"""
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from layercheck.workers.env import free_port
os.environ["MASTER_PORT"] = str(free_port())
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.workers.engine import build_engine, build_model, warm_engine_imports
from layercheck.workers.env import init_distributed
run = load_run_config("examples/demo.toml", {{"engine.zero_stage": 3}})
model = build_model(run.model)
if {warm}:
    warm_engine_imports()
before = set(sys.modules)
init_distributed()
build_engine(run.model, run.optim, run.engine, model=model)
muon = sorted(m for m in set(sys.modules) - before if m.startswith("deepspeed.runtime.zero.muon"))
print("muon imported by the build:", len(muon), muon[:5])
print("inductor:", "torch._inductor.compile_fx" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    muon = int(re.search(r"muon imported by the build: (\d+)", result.stdout).group(1))
    assert (muon == 0) if warm else (muon > 0), result.stdout
    assert "inductor: False" in result.stdout, result.stdout


def test_the_users_loop_starts_with_deepspeed_imported_and_muon_imported_without_inductor():
    """``layercheck.LayerCheckTrainer`` wraps the user's loop (``call_with_context``): where the loop
    imports DeepSpeed itself and builds its engine, DeepSpeed's Muon is already imported, with its
    ``torch.compile`` deferred, so that build pays no inductor import either (``attach``'s runs)."""
    import subprocess
    import sys

    code = """
import sys
from layercheck.orchestrator.core.run_config import FaultConfig
from layercheck.orchestrator.runtime.context import WorkerContext, call_with_context
context = WorkerContext(run_id="r", storage_uri="/tmp/x", fsync=False, max_inflight_bytes=1, fault=FaultConfig(),
                        drift_probe="snapshot_diff", layer_map=None, layer_numel={})
print("deepspeed before:", "deepspeed" in sys.modules)
seen = call_with_context(lambda: ("deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules, "torch._inductor.compile_fx" in sys.modules), context)
print("in the loop (muon, inductor):", seen)
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "deepspeed before: False" in result.stdout, result.stdout
    assert "in the loop (muon, inductor): (True, False)" in result.stdout, result.stdout


def test_a_deferred_compile_compiles_once_at_the_first_call_with_the_options_given():
    """What Muon's import gets instead of ``torch.compile``: the same result, compiled lazily."""
    compiled: list[tuple[Any, dict[str, Any]]] = []

    def fake_compile(fn, **options):
        compiled.append((fn, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    deferred = ds_internals.compile_on_first_call(fake_compile)

    @deferred(mode="max-autotune")
    def double(x):
        """Twice x."""
        return 2 * x

    plain = deferred(lambda x: x + 1)
    assert compiled == [] and double.__doc__ == "Twice x."  # nothing compiled at decoration
    assert double(3) == ("compiled", 6) and double(x=4) == ("compiled", 8)
    assert plain(1) == ("compiled", 2)
    assert [options for _, options in compiled] == [{"mode": "max-autotune"}, {}]  # once each


@pytest.mark.parametrize("way", ["layercheck", "group_formed_first", "users_loop"])
def test_deepspeeds_inference_only_cpu_comm_op_is_never_built(way, tmp_path):
    """DeepSpeed's CPU backend JIT-builds a shared-memory op for each process group it starts
    (30-40 s on a fresh machine, under a lock a killed build leaves behind) that only
    ``inference_all_reduce`` uses: neither LayerCheck's group nor a user's ``deepspeed.initialize``
    after ``LayerCheckTrainer``'s wrapper (``warm_engine_imports``) builds or loads it, and that
    all-reduce still works, through torch's. A fresh extension cache shows any build."""
    import subprocess
    import sys

    deepspeed_starts = "import deepspeed; deepspeed.init_distributed(dist_backend='gloo', auto_mpi_discovery=False)"
    start = {
        "layercheck": "from layercheck.workers.env import init_distributed; init_distributed()",
        # as under Ray Train: torch's group first, then LayerCheck's engine build, whose
        # deepspeed.initialize starts DeepSpeed's backend
        "group_formed_first": "import torch; torch.distributed.init_process_group('gloo'); "
        "from layercheck.workers.env import init_distributed; init_distributed(); " + deepspeed_starts,
        "users_loop": "from layercheck.workers.engine import warm_engine_imports; warm_engine_imports(); "
        + deepspeed_starts,
    }[way]
    code = f"""
import os
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from layercheck.workers.env import free_port
os.environ["MASTER_PORT"] = str(free_port())
{start}
import torch
from deepspeed.comm import comm
tensor = torch.ones(3)
comm.inference_all_reduce(tensor)
print("op:", comm.cdb.shm_comm_op, "sum:", float(tensor.sum()))
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "op: None sum: 3.0" in result.stdout
    assert list(tmp_path.iterdir()) == []
