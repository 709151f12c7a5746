"""Storage and writer faults, without Ray: a dead writer's versions are lost once and free the
gate; storage failures, or storage that does not answer, that break smax are reported once and
(by config) stop every rank after the same step; the summary's breach row and failure counts
agree; a resumed run counts staleness from its stored versions; the config's fields for it and
the Ray-job storage check name what to do."""

import logging

import pytest

from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.orchestrator.core.persistence.staleness_guard import (
    HUNG_WRITE_REQUESTS,
    PIPELINE_LAG,
    StalenessGuard,
    StalenessLimits,
    StorageFacts,
)
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.run_config import (
    RAY_JOB_ENV,
    check_relative_storage,
    load_run_config,
)
from layercheck.orchestrator.core.run_supervisor import RunSupervisor
from layercheck.orchestrator.core.supervision_ports import LocalPolicy
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.uri import S3ClientOptions
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.config_loader import ConfigError
from layercheck.policies.configs import IntervalConfig, LayerCheckConfig
from layercheck.workers.progress import StepProgress
from tests.support.clock import ManualClock
from tests.support.store_helpers import faulty_store, write_layer, written_receipts

LAYERS = ("embed", "block.0", "norm")
SMAX = 5
HUNG_WRITE_S = 2.0


class Writers:
    def drain(self, deadline_s):
        return ()

    def replace(self, names):
        pass


def make(tmp_path, on_breach="stop", *, clock=None, store=None, smax=SMAX, resume=False):
    """A supervisor on a real store (``store``, else a fresh one) whose clock only moves by hand;
    ``resume``: of a stored run (``--resume``)."""
    config = LayerCheckConfig(k0=1e9, k0_embed=1e9, smax=smax, warmup_steps=2, threshold_schedule="constant")
    service = PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, 2)
    run = RunSupervisor(
        run_id="r",
        store=store if store is not None else LayerStore.open(str(tmp_path / "store")),
        layer_numel={n: 42 for n in LAYERS},
        policy=LocalPolicy(service),
        writers=Writers(),
        limits=StalenessLimits.of(config, on_breach=on_breach, hung_write_s=HUNG_WRITE_S),
        clock=clock if clock is not None else ManualClock(),
        sleep=lambda seconds: None,  # commit retries' backoff
        resume=resume,
    )
    return run, service


def report(service, step):
    decision = None
    for rank in (0, 1):
        decision = service.report(
            step=step, rank=rank, lr=1e-3, abs_sums={n: 0.0 for n in LAYERS}, counts={n: 42 for n in LAYERS}
        )
    return decision


def progress(run, step, handed_over=()):
    run.progress(StepProgress(step=step, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0, handed_over=handed_over))


def train_past_smax(run, service, caplog, *, clock=None, seconds_per_step=1.0):
    """Steps until every layer is well past ``smax`` with nothing committed, rank 0 handing each
    step's decision over after the next step (the loop's ``DECISION_LAG``) and, with ``clock``,
    ``seconds_per_step`` passing per step; the run's status."""
    handed: tuple[str, ...] = ()
    with caplog.at_level(logging.WARNING):
        for step in range(1, 8 + SMAX + PIPELINE_LAG):
            if clock is not None:
                clock.now += seconds_per_step
            decision = report(service, step)
            progress(run, step, handed)
            handed = decision.names if decision else ()
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
    assert status.lost_versions == 3 and status.writers_replaced == 1
    assert all("writer died" in reason for reason in status.lost)
    assert service.gate.in_flight == {}  # settled: the next decision may persist them again


def test_storage_failures_past_smax_are_a_breach_reported_once_and_stop_every_rank_after_the_same_step(tmp_path):
    run, service = make(tmp_path, on_breach="stop")
    for step in range(1, 3 + SMAX + PIPELINE_LAG):
        report(service, step)
        progress(run, step)
    assert run.status().staleness_breach is None  # past smax, but no storage failure: slow, not broken
    run.write_failed("embed", 2)
    step = 3 + SMAX + PIPELINE_LAG
    report(service, step)
    progress(run, step)
    status = run.status()
    breach = status.staleness_breach
    assert breach["action"] == "stop" and breach["staleness"] > SMAX + PIPELINE_LAG
    assert "storage failures broke the staleness bound" in status.stop_reason
    assert not service.stopping(step)  # the decision every rank already read does not change
    assert service.stopping(step + 1) and report(service, step + 1) is not None
    progress(run, step + 1)
    assert run.status().staleness_breach == breach  # once


def test_warn_keeps_training_and_reports_the_breach(tmp_path):
    run, service = make(tmp_path, on_breach="warn")
    run.write_failed("embed", 2)
    for step in range(1, 4 + SMAX + PIPELINE_LAG):
        report(service, step)
        progress(run, step)
    status = run.status()
    assert status.staleness_breach["action"] == "warn" and status.stop_reason is None
    assert service.stop_from is None


def test_storage_that_hangs_without_failing_breaks_the_bound_and_stops_the_run(tmp_path, caplog):
    """No write failed, yet no version committed (an endpoint that accepts and never answers):
    once a layer passes the bound while the oldest unwritten version has waited past
    ``persistence.hung_write_s`` with nothing committed, that is a breach by storage that does not
    answer, reported once, and by default every rank stops after the same step."""
    clock = ManualClock()
    run, service = make(tmp_path, on_breach="stop", clock=clock)
    status = train_past_smax(run, service, caplog, clock=clock)
    breach = status.staleness_breach
    assert breach is not None and breach["action"] == "stop" and breach["storage_failures"] == 0
    assert breach["staleness"] > SMAX + PIPELINE_LAG and not breach["at_end"]
    # the base (decided at the end of warm-up, step 2) was handed over after step 3 and never written
    unwritten = breach["unwritten"]
    assert (unwritten["step"], unwritten["layer"] in LAYERS) == (3, True) and unwritten["waited_s"] > HUNG_WRITE_S
    assert "storage that does not answer" in breach["message"] and "persistence.hung_write_s = 2 s" in breach["message"]
    assert "storage that does not answer broke the staleness bound" in status.stop_reason
    assert service.stop_from == breach["step"] + 1  # every rank stops after the same step
    assert sum(m.startswith("staleness bound broken") for m in caplog.messages) == 1


def test_storage_that_is_slow_but_commits_is_lag_even_while_one_version_waits_long(tmp_path, caplog):
    """Slow storage that keeps committing is no hang: a version that has waited in a writer's queue
    longer than ``persistence.hung_write_s`` while other versions committed meanwhile leaves the
    bound passed as lag (a warning), not a breach; the run goes on."""
    clock = ManualClock()
    store = LayerStore.open(str(tmp_path / "store"))
    run, service = make(tmp_path, on_breach="stop", clock=clock, store=store)
    progress(run, 1, handed_over=LAYERS)  # every layer's version of step 1 handed over at t = 0
    for layer, at in (("embed", 1.5), ("block.0", 3.0)):  # storage writes one version every 1.5 s
        clock.now = at
        for receipt in written_receipts(store, layer, 1):
            run.shard_written(receipt, 1.5)
    with caplog.at_level(logging.WARNING):
        for step in range(2, 10):  # norm's version has waited 3 s and more, the others past smax + lag
            clock.now += 0.1
            progress(run, step)
    status = run.status()
    assert status.layers["embed"].last_step == 1 and status.max_staleness > SMAX + PIPELINE_LAG
    assert status.staleness_breach is None and status.stop_reason is None and service.stop_from is None
    lag = status.staleness_lag
    assert lag is not None and lag["storage_failures"] == 0 and "storage that does not keep up" in lag["message"]
    assert sum("storage that does not keep up" in m for m in caplog.messages) == 1


def test_a_writer_that_died_on_slow_storage_is_named_not_blamed_on_storage_and_does_not_stop(tmp_path, caplog):
    """A writer killed while storage is slow: its snapshots go to a replacement (nothing lost), so
    the bound passed meanwhile is lag that names the dead writer, not a storage failure that stops."""
    from layercheck.orchestrator.runtime.run_summary import _trouble_rows

    run, service = make(tmp_path, on_breach="stop")
    run.writer_died(lost=[], reason="their writer died twice (ActorDiedError)")
    status = train_past_smax(run, service, caplog)
    lag = status.staleness_lag
    assert status.staleness_breach is None and status.stop_reason is None and status.lost_versions == 0
    assert lag["storage_failures"] == 0 and lag["writers_replaced"] == 1
    assert "storage that does not keep up" in lag["message"] and "1 persistence writer(s) died" in lag["message"]
    rows = dict((row[0], row[1]) for row in _trouble_rows(status.as_dict()))
    assert rows["writers replaced"] == (
        "1 (a persistence writer died; what they held went to the replacement and was written: nothing lost)"
    )


def test_policies_without_smax_are_never_breached():
    guard = StalenessGuard(limits=StalenessLimits.of(IntervalConfig(interval=10), on_breach="stop"))
    assert guard.check(step=10_000, last_steps={"embed": None}, facts=StorageFacts(write_failures=5)) is None


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


def test_hung_write_s_is_validated_and_by_default_outlasts_any_write_the_s3_client_can_fail():
    with pytest.raises(ConfigError, match="hung_write_s"):
        load_run_config("examples/demo.toml", {"persistence.hung_write_s": 0})
    assert load_run_config("examples/demo.toml", {"persistence.hung_write_s": 1.5}).persistence.hung_write_s == 1.5
    client = S3ClientOptions()
    worst_request = client.retry_max_attempts * (client.connect_timeout + client.request_timeout)
    assert PersistenceConfig().hung_write_s == HUNG_WRITE_REQUESTS * worst_request


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


def test_failures_known_after_the_bound_was_passed_turn_the_lag_into_a_breach_the_summary_agrees_with(tmp_path, caplog):
    """The bound was passed while no failure was known yet (lag); the writers' failures arrive
    after the last step, in the end-of-run drain (an endpoint that answers only with timeouts):
    the final check makes it a breach, and the summary's breach row names the same failures its
    counts row shows, with no "no write failed" row beside them."""
    from layercheck.orchestrator.runtime.run_end import RunResult
    from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
    from layercheck.policies.trace import DriftTrace

    store, disk = faulty_store(str(tmp_path / "store"))
    run, service = make(tmp_path, on_breach="stop", store=store)
    status = train_past_smax(run, service, caplog)
    assert status.staleness_lag is not None and status.staleness_breach is None
    last = status.step
    # the end-of-run drain: two shards fail, and a version's commit fails every try (counted lost)
    receipts = written_receipts(store, "embed", 3)
    disk.read_only = True
    run.write_failed("block.0", 3)
    run.write_failed("norm", 3)
    for receipt in receipts:
        run.shard_written(receipt, 0.1)
    run.steps_ended()
    status = run.status()
    tries = run.commits.config.commit_tries
    assert (status.write_failures, status.commit_retries, status.lost_versions) == (2, tries - 1, 1)
    breach = status.staleness_breach
    assert breach["action"] == "stop" and breach["at_end"] and breach["step"] <= last
    assert (breach["write_failures"], breach["commit_failures"], breach["storage_failures"]) == (2, tries, 2 + tries)
    assert f"2 failed write(s), {tries} failed commit(s)" in breach["message"]
    assert "storage failures broke the staleness bound" in status.stop_reason
    result = RunResult(
        run_id="r",
        config=None,
        status=status.as_dict(),
        trace=DriftTrace.from_json({"steps": [], "layers": [{"name": n, "numel": 42} for n in LAYERS]}),
        layer_numel={n: 42 for n in LAYERS},
        error=f"stopped after step {last}: {status.stop_reason}",
        storage_uri=str(tmp_path / "store"),
        policy=LayerCheckConfig(smax=SMAX, warmup_steps=2),
    )
    text = format_summary(summarize(result))
    assert f"2 / {tries - 1} / 1" in text and "STALENESS BOUND BROKEN" in text
    assert f"2 failed write(s), {tries} failed commit(s)" in text and "after the last step" in text
    assert "STALENESS BOUND PASSED" not in text and "no write failed" not in text


def test_a_resumed_run_counts_staleness_from_its_stored_versions(tmp_path, caplog):
    """``--resume`` of a run whose store holds embed at step 26 and the other layers at step 30:
    it resumes at step 31, and at step 42 embed is 16 steps stale (not 42, as if nothing were
    stored): within smax + lag, so no lag and no breach."""
    store = LayerStore.open(str(tmp_path / "store"))
    for layer, step in (("embed", 26), ("block.0", 30), ("norm", 30)):
        write_layer(store, layer, step)
    run, _ = make(tmp_path, on_breach="stop", store=store, smax=20, resume=True)
    resume = run.join(0, 2, "a0")
    assert run.join(1, 2, "a1") == resume and resume.start_step == 31
    with caplog.at_level(logging.WARNING):
        for step in range(31, 43):
            progress(run, step)
    status = run.status()
    assert status.staleness == {"embed": 16, "block.0": 12, "norm": 12} and status.max_staleness == 16
    assert status.staleness_lag is None and status.staleness_breach is None
    assert not any("staleness bound" in m for m in caplog.messages)
