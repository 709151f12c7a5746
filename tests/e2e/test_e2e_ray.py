"""End to end on a real local Ray: Ray Train workers running DeepSpeed ZeRO-3 on CPU (gloo),
the policy actor, the writers and the supervisor; a worker SIGKILLed mid-run; recovery.

``LAYERCHECK_E2E_OVERRIDES`` (a JSON object of run-config keys, e.g. ``{"cluster.use_gpu": true,
"engine.precision": "bf16"}``) changes every run here (``tests/support/ray_runs.py``):
``scripts/gpu_checks.sh`` runs them with NCCL and bf16 that way."""

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from layercheck.orchestrator.runtime.run_summary import format_summary, summarize
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE, LayerStore
from layercheck.orchestrator.store.recovery_source import VersionReader
from layercheck.policies.configs import IntervalConfig, LayerCheckConfig
from layercheck.policies.trace import DriftTrace
from layercheck.workers.lr_schedule import lr_at
from layercheck.workers.shard import STATE_KEYS
from tests.support.faults import FaultPlan, injected
from tests.support.ray_runs import EVERY_STEP, KILL_AT, UNBOUNDED, train_demo
from tests.support.store_helpers import flip_data_byte

pytestmark = pytest.mark.slow


def assert_failure_free_losses(failed, clean_run) -> None:
    """Every step of ``failed`` trained once, each loss the failure-free run's."""
    history = {int(k): v[0] for k, v in failed.status["account"]["history"].items()}
    assert sorted(history) == list(range(1, 13))  # no step skipped or repeated
    reference = {int(k): v[0] for k, v in clean_run.status["account"]["history"].items()}
    for step, loss in history.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def test_recovery_from_per_step_versions_continues_the_failure_free_trajectory(local_ray, clean_run, tmp_path):
    """With every layer persisted every step, the composite at t_fail is the exact state after
    t_fail: resuming at t_fail + 1 must reproduce the failure-free losses step for step. The run
    asks for in-place recovery, but every rank dies at once after step 6 (the test injector's
    ``kill_all_ranks_at_step``): the full restart runs, and the summary and the recovery say why."""
    clean = clean_run
    with injected(FaultPlan(kill_all_ranks_at_step=6)):
        failed = train_demo(tmp_path, "failed", policy=EVERY_STEP, **{"cluster.in_place": True, **UNBOUNDED})

    account = failed.status["account"]
    assert account["failures"] == 1
    (recovery,) = account["recoveries"]
    assert recovery["t_fail"] == 6 and recovery["resumed_at"] == 7 and recovery["steps_redone"] == 0
    assert recovery["path"] == "full restart" and recovery["fallback"] == "no_survivor", recovery
    assert "full restart (not in place: no rank survived the failure)" in format_summary(summarize(failed))
    assert recovery["max_staleness"] == 0  # the version taken after step 6 is in the composite
    # timed from the failure to the next completed step: the new group's engine build, its load
    # and its first step are in it (the join alone ends before the engine is even built)
    timeline = recovery["timeline"]
    assert timeline["start"] > 0 and timeline["build"] > 0 and timeline["first_step"] > 0, timeline
    assert recovery["total_s"] == recovery["failure_to_step_s"]
    hidden = recovery["detect_restart_s"] + recovery["plan_s"] + recovery["load_s"]  # what the summary said before
    assert recovery["failure_to_step_s"] > hidden + timeline["first_step"], recovery
    # the composite came from the writer's memory (one node: its own writer), not from storage;
    # each rank read every rank file's header and the tensors of only its own files, so the bytes
    # read add up to the composite (and its headers), not to the composite times the world size
    world = failed.config.cluster.num_workers
    assert recovery["memory_local_shards"] == world * len(failed.layer_numel), recovery
    composite = sum(r.nbytes for r in LayerStore.open(failed.storage_uri).versions() if r.step == 6)
    assert composite <= recovery["memory_local_bytes"] <= 1.1 * composite, (recovery, composite)
    assert recovery["storage_shards"] == recovery["storage_bytes"] == 0
    assert recovery["memory_remote_shards"] == recovery["memory_rejected"] == 0
    memory = failed.status["memory"]
    assert memory["held_bytes"] > 0 and memory["mirror_bytes"] == 0 and memory["writers"] == 1
    text = format_summary(summarize(failed))
    assert "composite loaded from" in text and "recovery memory (writers)" in text
    history = {int(k): v for k, v in account["history"].items()}
    assert sorted(history) == list(range(1, 13))  # no step skipped or repeated
    clean_history = {int(k): v for k, v in clean.status["account"]["history"].items()}
    config = failed.config
    for step, (loss, lr) in history.items():
        assert lr == pytest.approx(lr_at(step - 1, config.optim))  # the schedule continues
        assert loss == pytest.approx(clean_history[step][0], rel=1e-5, abs=1e-6), step
    assert failed.status["state"] == "finished"

    # Ray Train saw the progress: one report every log_every steps and one at the end, every rank
    # (a rank missing one would hang the group), rank 0's with the supervisor's staleness and ETTR
    reports = clean.train_reports
    assert [r["step"] for r in reports] == [4, 8, 12, 12]
    assert all({"step", "loss", "max_staleness", "ettr"} <= set(r) for r in reports)
    assert [r["loss"] for r in reports[:3]] == pytest.approx([clean_history[s][0] for s in (4, 8, 12)])
    assert reports[-1]["max_staleness"] is not None and 0 < reports[-1]["ettr"] <= 1


def test_a_failed_in_place_recovery_falls_back_to_replacing_every_rank_within_one_failure(
    local_ray, clean_run, tmp_path
):
    """``cluster.in_place`` with ``cluster.max_failures = 1``, rank 1 SIGKILLed after step 6: Ray
    Train replaces rank 1 (the one failure allowed) and rank 0 recovers in its own process, but
    that recovery raises (the test injector's ``fail_in_place_recovery``, before its load). Rank 0 says why and
    leaves; that turns in-place recovery off, so rank 1's replacement leaves too as it sees rank
    0 go. Neither leave is charged to ``max_failures`` (one death, one charge, as under a full
    restart): both are replaced, the new processes recover cold, and the run resumes at
    t_fail + 1 on the failure-free trajectory; the summary says why it was no recovery in place."""
    failing = {"fault.kill_at_step": 6, "fault.kill_rank": 1, "cluster.in_place": True, "cluster.max_failures": 1}
    with injected(FaultPlan(kill_rank=1, fail_in_place_recovery=True)):
        failed = train_demo(tmp_path, "refused", policy=EVERY_STEP, **{**failing, **UNBOUNDED})
    assert failed.status["state"] == "finished"
    account = failed.status["account"]
    recovery = account["recoveries"][-1]
    assert (recovery["t_fail"], recovery["resumed_at"], recovery["steps_redone"]) == (6, 7, 0), recovery
    assert recovery["path"] == "full restart" and recovery["kept_processes"] == 0, recovery
    assert recovery["fallback"] == "recovery_failed", recovery
    text = format_summary(summarize(failed))
    assert "full restart (not in place: a survivor's recovery in its own process failed; rank 0: InjectedFault" in text
    assert_failure_free_losses(failed, clean_run)


def test_a_rank_whose_own_step_fails_is_replaced_in_place_and_so_is_its_replacement_lost_in_the_recovery(
    local_ray, clean_run, tmp_path
):
    """``cluster.in_place``, two failures in one recovery. Rank 1's loop raises an error of its own
    after step 6 (no lost peer: the test injector's ``raise_at_step``): it says so and raises, Ray Train replaces
    it (charged, as any failure), and rank 0 sees it go like a lost peer and recovers in its own
    process. The replacement is SIGKILLed during that recovery (it joined and formed the new group,
    and had not loaded; ``kill_again_in_recovery``): rank 0 sees the new peer lost like the
    first and recovers in place once more with the next replacement. The run resumes at t_fail + 1
    on the failure-free trajectory, rank 0 in the process it started in, and the summary names the
    rank whose step failed although the recovery that answered it was overtaken."""
    with injected(FaultPlan(raise_at_step=6, kill_rank=1, kill_again_in_recovery=True)):
        failed = train_demo(tmp_path, "own-error", policy=EVERY_STEP, **{"cluster.in_place": True, **UNBOUNDED})
    assert failed.status["state"] == "finished"
    account = failed.status["account"]
    assert account["failures"] == 2, account["recoveries"]
    first, recovery = account["recoveries"]
    assert first["refused"]["reason"] == "rank_failed", first
    assert (recovery["t_fail"], recovery["resumed_at"], recovery["steps_redone"]) == (6, 7, 0), recovery
    assert recovery["path"] == "in place" and recovery["kept_processes"] == 1, recovery
    pids = {r["pid"] for r in failed.train_reports}  # Ray Train keeps rank 0's reports
    assert len(pids) == 1 and failed.train_reports, f"rank 0 ran in {len(pids)} processes: {sorted(pids)}"
    text = format_summary(summarize(failed))
    assert "(replaced a rank whose own step failed: rank 1: InjectedFault: fault injection" in text, text
    assert "in place (1 rank kept its process)" in text, text
    assert_failure_free_losses(failed, clean_run)


def test_a_rank_waiting_for_a_decision_that_a_lost_peer_never_reported_is_released(local_ray):
    """The real policy actor and a rank's real coordinator: rank 0's report of step 1 waits for
    rank 1's, which never comes (it died before its report was taken in), so rank 0 waits outside
    any collective. Told of the loss as Ray Train's controller tells it (``ReplaceInPlace`` ->
    ``request_abort``), the wait raises ``PeerLost``, a lost peer to ``lost_a_peer``: the rank
    recovers in place instead of waiting for good (a CI hang)."""
    import threading

    import ray

    from layercheck.orchestrator.runtime.in_place import lost_a_peer
    from layercheck.orchestrator.runtime.policy_actor import PolicyActor
    from layercheck.orchestrator.runtime.ray_coordinator import RayCoordinator
    from layercheck.workers import collective_abort
    from layercheck.workers.collective_abort import CollectiveAbort, PeerLost
    from layercheck.workers.drift.probe import LayerDrift

    numel = {"embed": 10}
    policy = PolicyActor.remote(IntervalConfig(interval=1), numel, 2, 4)
    rank0 = RayCoordinator(rank=0, policy=policy, writer=None, supervisor=None, max_inflight_bytes=1)
    watcher = collective_abort.install(CollectiveAbort(backend="gloo"))
    try:
        watcher.arm()
        handle = rank0.report(LayerDrift(step=1, l1={"embed": 0.1}, numel=numel, measured=True), 1e-3)
        asked = threading.Timer(1.0, collective_abort.request_abort, args=("Ray Train replaces rank(s) [1] in place",))
        asked.start()
        with pytest.raises(PeerLost, match="no decision for step 1") as released:
            rank0.decision(handle)
        assert lost_a_peer(released.value)
    finally:
        collective_abort.install(None)
        ray.kill(policy)


def test_the_survivor_hands_over_its_own_slices_at_t_fail_bit_for_bit(local_ray, clean_run, tmp_path):
    """ZeRO-3 on 2 ranks, a sparse schedule, rank 1 SIGKILLed after step 6: rank 0's next
    collective raises, it captures its partition of every layer at step 6 and its writer persists
    that as a partial version, bit for bit the failure-free state at step 6. With memory versions
    every 3 steps (held by the writers, never stored), every layer's composite is the memory version
    at step 6 (the capture, of the same step, adds nothing to it), the state at t_fail: the losses
    after it are the failure-free run's."""
    clean = clean_run
    sparse = IntervalConfig(interval=4)  # every layer at step 4 or 5 (whole versions); the capture is fresher
    failed = train_demo(
        tmp_path, "captured", policy=sparse, **{"fault.kill_at_step": 6, "persistence.memory_period": 3}
    )
    account = failed.status["account"]
    (recovery,) = account["recoveries"]
    assert recovery["t_fail"] == 6 and recovery["resumed_at"] == 7
    assert recovery["path"] == "full restart" and recovery["kept_processes"] == 0
    assert recovery["max_staleness"] == 0 and recovery["elements"]["stored"] == 0 < recovery["elements"]["memory"]
    for layer, sources in recovery["sources"].items():
        assert [(s["origin"], s["step"]) for s in sources] == [("memory", 6)], layer
    clean_history = {int(k): v for k, v in clean.status["account"]["history"].items()}
    for step, (loss, _) in account["history"].items():
        assert loss == pytest.approx(clean_history[int(step)][0], rel=1e-5, abs=1e-6), step
    assert not [v for v in LayerStore.open(failed.config.storage_uri).versions() if v.origin == "memory"]
    summary = summarize(failed)  # judged from what it loaded: every slice within memory_period
    assert [c["kept"] for c in summary["memory_period_checks"]] == [True], summary["memory_period_checks"]
    text = format_summary(summary)
    assert "memory_period kept" in text and "every element came back at most 3 steps stale" in text
    (capture,) = account["capture"]["captures"]
    assert (capture["rank"], capture["step"], capture["held"]) == (0, 6, True)
    assert capture["layers"] == len(failed.layer_numel) and capture["nbytes"] > 0
    (hold,) = account["capture"]["holds"]
    assert hold["survivors"] == [0] and hold["captured"] == [0]
    # a survivor Ray Train has not yet seen fail is asked to abort a blocked collective: on gloo it
    # raised (or raises) by itself (one it has seen fail already raised, and is not asked)
    answers = {"already_raised", "not_needed"} | ({"abort"} if failed.config.cluster.use_gpu else set())
    assert set(hold["released"].values()) <= answers, hold

    store, reference = LayerStore.open(failed.config.storage_uri), LayerStore.open(clean.config.storage_uri)
    captured = [v for v in store.versions() if v.origin == "capture"]
    assert {v.layer for v in captured} == set(failed.layer_numel)
    assert all(v.partial and v.step == 6 and [s.rank for s in v.shards] == [0] for v in captured)
    at_6 = {v.layer: v for v in reference.versions() if v.step == 6}
    for version in captured:
        assert store.check_version(version, deep=True) == []
        with VersionReader(store, version) as got, VersionReader(reference, at_6[version.layer]) as want:
            for piece in got.headers()[0].slices:
                for key in STATE_KEYS:
                    mine = got.read(piece.name, key, piece.offset, piece.length)
                    assert torch.equal(mine, want.read(piece.name, key, piece.offset, piece.length)), (
                        version.layer,
                        piece.name,
                        key,
                    )


def test_with_zero0_an_in_place_recovery_with_a_warm_spare_is_exact_under_a_sparse_schedule(local_ray, tmp_path):
    """ZeRO-0 (every rank holds everything), ``cluster.in_place`` with ``cluster.spares = 1``: Ray
    Train runs a third worker that builds its model and waits. Rank 1 is SIGKILLed after step 6; as
    Ray Train shuts it down to replace it, the spare is promoted to rank 1 (no process start, its
    model built), rank 0 keeps its process, captures the whole state at t_fail and rebuilds its
    engine, and the replacement becomes the next spare. So recovery loses nothing although the
    stored versions are stale: every loss after it equals the failure-free run's — with dropout on,
    since each step's RNG seed is a function of the run's seed and the step's rows
    (``layercheck.workers.data.order.step_seed``). The capture's exactness under a full restart:
    ``test_the_survivor_hands_over_its_own_slices_at_t_fail_bit_for_bit``; in place without a
    spare: ``tests/e2e/test_own_loop.py``."""
    sparse = IntervalConfig(interval=4)
    zero0 = {"engine.zero_stage": 0, "steps": 9, "optim.total_steps": 9, "model.hf_config.attention_dropout": 0.1}
    clean = train_demo(tmp_path, "clean0", policy=sparse, **{"fault.kill_at_step": 0, **zero0})
    in_place = {"cluster.in_place": True, "cluster.spares": 1}
    failed = train_demo(tmp_path, "inplace0", policy=sparse, **{"fault.kill_at_step": 6, **in_place, **zero0})
    assert failed.error is None and failed.status["state"] == "finished", failed.error
    (recovery,) = failed.status["account"]["recoveries"]
    assert recovery["t_fail"] == 6 and recovery["resumed_at"] == 7, recovery
    # rank 0 recovered in its own process (a new incarnation of the same train function), rank 1 is the spare
    assert recovery["path"] == "in place" and recovery["kept_processes"] == 1, recovery
    assert recovery["spares_promoted"] == 1 and recovery["timeline"]["start"] == 0.0, recovery
    assert recovery["failure_to_step_s"] > 0 and recovery["timeline"]["group"] > 0, recovery
    assert failed.status["spares"]["promotions"] == 1, failed.status["spares"]
    assert "in place (1 rank kept its process, 1 spare promoted)" in format_summary(summarize(failed))
    assert failed.train_reports == []  # Ray Train's report, a barrier over all its workers, is off with spares
    stored = [v for v in LayerStore.open(failed.config.storage_uri).versions() if not v.partial and v.step <= 6]
    assert max(v.step for v in stored) < 6  # what storage alone would give is stale
    assert_same_losses_after(6, failed, clean)


def assert_same_losses_after(t_fail: int, failed, clean) -> None:
    history = {int(k): v[0] for k, v in failed.status["account"]["history"].items()}
    reference = {int(k): v[0] for k, v in clean.status["account"]["history"].items()}
    assert sorted(history) == sorted(reference)
    for step in range(t_fail + 1, max(reference) + 1):
        assert history[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step


def test_a_resume_whose_newest_version_has_a_corrupt_tensor_falls_back_to_the_previous_one(
    local_ray, clean_run, tmp_path
):
    """``--resume`` of a copy of the ``clean_run`` fixture's store (12 steps, every layer every step)
    in which one byte near the end of block.1's step-12 data is flipped: its size and header still
    match, so the pre-check passes it and the rank's load finds it. That rank reports the version
    and raises before any step is trained: the run is retried (not ended as a setup error), the
    retry's plan takes block.1 from step 11, and the run continues at step 13."""
    shutil.copytree(clean_run.config.storage_uri, tmp_path / "bad")
    store = LayerStore.open(str(tmp_path / "bad"))
    bad = max((v for v in store.versions() if v.layer == "block.1"), key=lambda v: v.step)
    assert bad.step == 12
    flip_data_byte(store, bad, rank=0)
    resumed = train_demo(
        tmp_path, "bad", policy=EVERY_STEP, resume=True, **{"cluster.num_workers": 1, "steps": 14, "log_every": 1}
    )
    account = resumed.status["account"]
    assert resumed.status["attempt"] == 2  # the resume's group, then its retry
    assert [(r["t_fail"], r["resumed_at"]) for r in account["recoveries"]] == [(12, 13), (12, 13)]
    history = {int(k): v[0] for k, v in account["history"].items()}
    assert sorted(history) == [13, 14]  # nothing skipped, nothing repeated
    first_losses = {int(k): v[0] for k, v in clean_run.status["account"]["history"].items()}
    assert abs(history[13] - first_losses[12]) < 0.3  # the trained weights came back


def test_a_failure_before_any_layer_was_saved_resumes_at_t_fail_plus_one(local_ray, tmp_path):
    """The paper's policy with its default warm-up (200 steps) in an 8-step run: no layer is ever
    saved before rank 1 dies after step 4. The run's initial state is every layer's version at step
    0 (recorded at its start, no bytes written), so recovery still resumes at 5: rank 0's slices
    from its capture, rank 1's from the initial state, staleness counted from step 0."""
    steps = {"steps": 8, "optim.total_steps": 8}
    # no memory versions (the default takes them from step 2): rank 1's slices from the initial state
    steps["persistence.memory_period"] = 0
    failed = train_demo(tmp_path, "early", policy=LayerCheckConfig(), **{"fault.kill_at_step": 4, **steps})
    (recovery,) = failed.status["account"]["recoveries"]
    assert (recovery["t_fail"], recovery["resumed_at"], recovery["steps_redone"]) == (4, 5, 0)
    assert recovery["max_staleness"] == 4
    for layer, sources in recovery["sources"].items():
        assert [(s["origin"], s["step"]) for s in sources] == [("capture", 4), ("initial", 0)], layer
    assert recovery["elements"]["initial"] > 0 and recovery["elements"]["stored"] == 0
    history = {int(k) for k in failed.status["account"]["history"]}
    assert history == set(range(1, 9))
    text = format_summary(summarize(failed))
    assert "from the initial state (not saved yet)" in text and "steps redone 0" in text


def test_layercheck_run_with_a_failure_recovers_from_a_mixed_composite(local_ray, layercheck_run):
    result = layercheck_run[0]  # the layercheck policy (Smax 4), rank 1 SIGKILLed after step 8
    status = result.status
    (recovery,) = status["account"]["recoveries"]
    assert recovery["resumed_at"] == recovery["t_fail"] + 1 == 9
    # staleness is bounded by Smax plus the one-step decision lag
    assert 0 <= recovery["max_staleness"] <= 4 + 1
    assert status["max_staleness"] <= 4 + 1
    versions = LayerStore.open(result.config.storage_uri).versions()
    # every layer has a version from before the failure (the base, or a newer one that superseded
    # it in a writer's queue when the writer fell behind)
    assert {v.layer for v in versions if v.step <= recovery["t_fail"]} == set(result.layer_numel)
    assert any(v.base for v in versions)
    # whole versions, and apart from them the parts of incomplete ones that the survivor wrote (when
    # its writer got to a version the killed rank's never did: a matter of timing)
    whole, partial = [v for v in versions if not v.partial], [v for v in versions if v.partial]
    assert status["bytes_committed"] == sum(v.nbytes for v in whole) > 0
    assert status["partial_bytes_committed"] == sum(v.nbytes for v in partial)
    assert status["partial_versions_committed"] == len(partial)
    summary = summarize(result)
    assert summary["steps"] == 12 and summary["failures"] == 1 and 0 < summary["ettr"] <= 1
    assert math.isfinite(summary["final_loss"])
    assert "recovery after step 8" in format_summary(summary)
    # persistence.memory_period left at its default ("auto"): every step at first, then the period
    # chosen from rank 0's timings of its first copies; the lost rank's slices came back from a
    # memory version within the period in force at the failure, and the summary says why that one
    choice = summary["memory_period_choice"]
    assert choice["auto"] and choice["chosen_at"] is not None and choice["chosen_at"] < KILL_AT, choice
    assert choice["why"].startswith(f"auto: {choice['period']} (copy ") and "of a " in choice["why"], choice
    assert re.search(rf"^memory versions +{re.escape(choice['why'])}$", format_summary(summary), re.M)
    assert status["memory"]["memory_version_shards"] > 0, status["memory"]  # held, at the end too
    (check,) = summary["memory_period_checks"]
    assert check["kept"] and check["period"] == choice["period"], check
    probe = summary["drift_probe"]  # the built-in loop's DriftAdamW on CPU, measuring every step
    assert probe["probe"] == "optimizer (foreach)" and probe["measured_steps"] == probe["steps"] >= 12, probe
    assert probe["seconds"] > 0 and "drift probe (rank 0)" in format_summary(summary)
    assert [o.step for o in result.trace.steps] == list(range(1, 13))  # the drift trace, minus nothing
    recorded = DriftTrace.parse(
        (Path(result.config.storage_uri) / DRIFT_TRACE_FILE).read_text()
    )  # for layercheck simulate
    assert recorded == result.trace


def test_a_stopped_run_resumes_from_its_store_at_another_world_size(local_ray, clean_run, tmp_path):
    """Saved by 2 ZeRO-3 ranks (a copy of the ``clean_run`` fixture's store: 12 steps, every layer
    every step), resumed by 1 for 4 more steps: each layer is re-sliced from the recorded offsets."""
    first = clean_run
    shutil.copytree(first.config.storage_uri, tmp_path / "grow")
    assert not (tmp_path / "grow" / "owner.json").exists()  # the first run released the store's lease
    # the README's form: num_workers changes (and steps, to train more); the demo's kill_rank = 1 is
    # outside the group (a warning)
    resumed = train_demo(
        tmp_path, "grow", policy=EVERY_STEP, resume=True, **{"cluster.num_workers": 1, "steps": 16, "log_every": 4}
    )
    account = resumed.status["account"]
    assert account["failures"] == 0
    (recovery,) = account["recoveries"]
    assert recovery["t_fail"] == 12 and recovery["resumed_at"] == 13 and recovery["max_staleness"] == 0
    assert recovery["kind"] == "resume"  # not a failure: the summary counts no recovery for it
    text = format_summary(summarize(resumed))
    assert "0 / 0" in text and "--resume from the store after step 12" in text
    history = {int(k): v for k, v in account["history"].items()}
    assert sorted(history) == [13, 14, 15, 16]
    first_losses = {int(k): v[0] for k, v in first.status["account"]["history"].items()}
    # the trained weights came back (a fresh model would be back near the step-1 loss)
    assert history[13][0] < first_losses[1] - 0.3
    assert abs(history[13][0] - first_losses[12]) < 0.3
