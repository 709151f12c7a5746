"""Storage and writer faults, without Ray: a dead writer's versions are lost once and free the
gate; storage failures that break smax are reported once and (by config) stop every rank after
the same step; the config's fields for it and the Ray-job storage check name what to do."""

import logging

import pytest

from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.run_config import RAY_JOB_ENV, check_relative_storage, load_run_config
from layercheck.orchestrator.core.run_supervisor import LocalPolicy, RunSupervisor
from layercheck.orchestrator.core.staleness_guard import PIPELINE_LAG, StalenessGuard, StalenessLimits
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import IntervalConfig, LayerCheckConfig
from layercheck.workers.progress import StepProgress

LAYERS = ("embed", "block.0", "norm")
SMAX = 5


class Writers:
    def drain(self, deadline_s):
        return ()

    def replace(self, names):
        pass


def make(tmp_path, on_breach="stop"):
    config = LayerCheckConfig(k0=1e9, k0_embed=1e9, smax=SMAX, warmup_steps=2, threshold_schedule="constant")
    service = PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, 2)
    run = RunSupervisor(
        run_id="r",
        store=LayerStore.open(str(tmp_path / "store")),
        layer_numel={n: 42 for n in LAYERS},
        policy=LocalPolicy(service),
        writers=Writers(),
        limits=StalenessLimits.of(config, on_breach=on_breach),
    )
    return run, service


def report(service, step):
    decision = None
    for rank in (0, 1):
        decision = service.report(
            step=step, rank=rank, lr=1e-3, abs_sums={n: 0.0 for n in LAYERS}, counts={n: 42 for n in LAYERS}
        )
    return decision


def progress(run, step):
    run.progress(StepProgress(step=step, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0))


def train_past_smax(run, service, caplog):
    """Steps until every layer is well past ``smax`` with nothing committed; the run's status."""
    with caplog.at_level(logging.WARNING):
        for step in range(1, 8 + SMAX + PIPELINE_LAG):
            report(service, step)
            progress(run, step)
    return run.status()


def test_a_dead_writers_versions_are_lost_once_and_the_layers_may_be_persisted_again(tmp_path):
    run, service = make(tmp_path)
    base = report(service, 1)
    base = report(service, 2)  # the base, at the end of warm-up
    assert set(base.names) == set(LAYERS) and set(service.gate.in_flight) == set(LAYERS)
    # both ranks used the writer that died; each reports what it had in it
    run.writer_died(lost=[("embed", 2), ("block.0", 2)], reason="their writer died twice (ActorDiedError)")
    run.writer_died(
        lost=[("embed", 2), ("block.0", 2), ("norm", 2)],
        replaced=False,
        reason="their writer died twice (ActorDiedError)",
    )
    status = run.status()
    assert status["lost_versions"] == 3 and status["writers_replaced"] == 1
    assert all("writer died" in reason for reason in status["lost"])
    assert service.gate.in_flight == {}  # settled: the next decision may persist them again


def test_storage_failures_past_smax_are_a_breach_reported_once_and_stop_every_rank_after_the_same_step(tmp_path):
    run, service = make(tmp_path, on_breach="stop")
    for step in range(1, 3 + SMAX + PIPELINE_LAG):
        report(service, step)
        progress(run, step)
    assert run.status()["staleness_breach"] is None  # past smax, but no storage failure: slow, not broken
    run.write_failed("embed", 2)
    step = 3 + SMAX + PIPELINE_LAG
    report(service, step)
    progress(run, step)
    status = run.status()
    breach = status["staleness_breach"]
    assert breach["action"] == "stop" and breach["staleness"] > SMAX + PIPELINE_LAG
    assert "storage failures broke the staleness bound" in status["stop_reason"]
    assert not service.stopping(step)  # the decision every rank already read does not change
    assert service.stopping(step + 1) and report(service, step + 1) is not None
    progress(run, step + 1)
    assert run.status()["staleness_breach"] == breach  # once


def test_warn_keeps_training_and_reports_the_breach(tmp_path):
    run, service = make(tmp_path, on_breach="warn")
    run.write_failed("embed", 2)
    for step in range(1, 4 + SMAX + PIPELINE_LAG):
        report(service, step)
        progress(run, step)
    status = run.status()
    assert status["staleness_breach"]["action"] == "warn" and status["stop_reason"] is None
    assert service.stop_from is None


def test_storage_that_hangs_without_failing_is_reported_once_and_does_not_stop_the_run(tmp_path, caplog):
    """No write failed, yet no version committed (an endpoint that accepts and never answers):
    the bound is passed all the same, and the operator hears it — once, as a warning."""
    run, service = make(tmp_path, on_breach="stop")
    status = train_past_smax(run, service, caplog)
    lag = status["staleness_lag"]
    assert lag is not None and lag["storage_failures"] == 0 and "storage that does not keep up" in lag["message"]
    assert status["staleness_breach"] is None and status["stop_reason"] is None and service.stop_from is None
    assert sum("storage that does not keep up" in m for m in caplog.messages) == 1


def test_a_writer_that_died_on_slow_storage_is_named_not_blamed_on_storage_and_does_not_stop(tmp_path, caplog):
    """A writer killed while storage is slow: its snapshots go to a replacement (nothing lost), so
    the bound passed meanwhile is lag that names the dead writer, not a storage failure that stops."""
    from layercheck.orchestrator.runtime.summary import _trouble_rows

    run, service = make(tmp_path, on_breach="stop")
    run.writer_died(lost=[], reason="their writer died twice (ActorDiedError)")
    status = train_past_smax(run, service, caplog)
    lag = status["staleness_lag"]
    assert status["staleness_breach"] is None and status["stop_reason"] is None and status["lost_versions"] == 0
    assert lag["storage_failures"] == 0 and lag["writers_replaced"] == 1
    assert "storage that does not keep up" in lag["message"] and "1 persistence writer(s) died" in lag["message"]
    rows = dict((row[0], row[1]) for row in _trouble_rows(status))
    assert rows["writers replaced"] == (
        "1 (a persistence writer died; what they held went to the replacement and was written: nothing lost)"
    )


def test_policies_without_smax_are_never_breached():
    guard = StalenessGuard(limits=StalenessLimits.of(IntervalConfig(interval=10), on_breach="stop"))
    assert guard.check(step=10_000, last_steps={"embed": None}, storage_failures=5) is None


def test_a_stop_request_survives_a_restart_and_stops_the_new_group_at_once(tmp_path):
    _, service = make(tmp_path)
    for step in range(1, 6):
        report(service, step)
    service.request_stop("interrupted (Ctrl-C)")
    service.restart(world_size=2, resume_after=3, persisted_steps={n: 2 for n in LAYERS})
    assert service.stopping(4)


def test_on_staleness_breach_is_stop_or_warn():
    with pytest.raises(ConfigError, match="on_staleness_breach"):
        load_run_config("examples/demo.toml", {"persistence.on_staleness_breach": "ignore"})
    config = load_run_config("examples/demo.toml", {"persistence.on_staleness_breach": "warn"})
    assert config.persistence.on_staleness_breach == "warn" and config.persistence.save_final


def test_relative_storage_under_a_ray_job_is_an_error_naming_the_fix(tmp_path):
    cache = "/tmp/ray/session_x/runtime_resources/working_dir_files/_ray_pkg_abc"
    with pytest.raises(ConfigError, match="storage: .*Ray's working-dir cache.*absolute path.*URI"):
        check_relative_storage("runs/demo", cwd=cache, environ={})
    with pytest.raises(ConfigError, match="storage: .*under a Ray job"):
        check_relative_storage("runs/demo", cwd=str(tmp_path), environ={RAY_JOB_ENV: "{}"})
    check_relative_storage("runs/demo", cwd=str(tmp_path), environ={})  # a plain shell: fine


def test_a_relative_storage_under_ray_job_submit_is_refused_by_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    config = load_run_config("examples/demo.toml", {"storage": "runs/x"})
    with pytest.raises(ConfigError, match="storage"):
        config.with_absolute_storage()
    absolute = load_run_config("examples/demo.toml", {"storage": str(tmp_path / "x")})
    assert absolute.with_absolute_storage().storage == str(tmp_path / "x")
