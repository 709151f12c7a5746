"""RunSupervisor, the shell any runtime hosts, in one process (no Ray): a real store and policy
service; writers are fakes that script what a writer did (committed while drained, hung)."""

import math
import threading

import pytest

from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import ResumeInfo
from layercheck.orchestrator.core.run_supervisor import JoinDismissed, RunSupervisor
from layercheck.orchestrator.core.supervision_ports import LocalPolicy
from layercheck.orchestrator.store.errors import CorruptShardError
from layercheck.orchestrator.store.recovery_source import VersionReader
from layercheck.policies.checkpoint_policy import LayerCheckPolicy
from layercheck.policies.configs import LayerCheckConfig
from layercheck.workers.shard import STATE_KEYS
from tests.support.store_helpers import (
    PARAMS,
    cut_shards,
    even_cuts,
    faulty_store,
    flip_data_byte,
    layer_state,
    write_layer,
    written_receipts,
)

LAYERS = ("embed", "block.0", "norm")
NUMEL = {name: 42 for name in LAYERS}  # PARAMS: 6*5 + 5 + 7 elements per layer


class Writers:
    """Holds receipts a writer has not handed over yet; on a drain, a live writer hands them over
    from its own thread (as a Ray writer does, calling back while the recovery waits), a hung one never."""

    def __init__(self, hung=()):
        self.run = None
        self.held = []
        self.hung = tuple(hung)
        self.replaced = []

    def drain(self, deadline_s):
        if self.hung:
            return self.hung
        held, self.held = self.held, []
        thread = threading.Thread(target=lambda: [self.run.shard_written(r, 0.01) for r in held])
        thread.start()
        thread.join(timeout=60)  # a deadlock guard, not a timing check
        assert not thread.is_alive(), "a writer's commit deadlocked against the drain"
        return ()

    def replace(self, names):
        self.replaced += names


def policy_service():
    config = LayerCheckConfig(k0=1.0, k0_embed=1.0, smax=100, warmup_steps=1, threshold_schedule="constant")
    return PolicyService(LayerCheckPolicy(config, LAYERS), LAYERS, 2)


def make(store, writers, **kwargs):
    service = policy_service()
    run = RunSupervisor(
        run_id="r",
        store=store,
        layer_numel=NUMEL,
        policy=LocalPolicy(service),
        writers=writers,
        config=SupervisionConfig(drain_deadline_s=5.0, commit_backoff_s=0.5),
        **kwargs,
    )
    writers.run = run
    return run, service


def train(service, steps):
    for step in steps:
        for rank in (0, 1):
            service.report(
                step=step, rank=rank, lr=1e-3, abs_sums={n: 0.0 for n in LAYERS}, counts={n: 10 for n in LAYERS}
            )


def persist_all(run, store, step, writers=None):
    """Every layer's two shards written; rank 1's still in the writer when ``writers`` is given."""
    for layer in LAYERS:
        first, second = written_receipts(store, layer, step)
        run.shard_written(first, 0.01)
        if writers is None:
            run.shard_written(second, 0.01)
        else:
            writers.held.append(second)


def test_a_lost_group_resumes_after_t_fail_with_what_the_writers_committed_while_drained(store):
    writers = Writers()
    run, service = make(store, writers)
    assert run.join(0, 2, "a0") == run.join(1, 2, "a1") == ResumeInfo(1, 1)
    train(service, range(1, 6))
    persist_all(run, store, 3)
    persist_all(run, store, 5, writers)  # the group dies with rank 1's step-5 shards in its writer
    resume = run.join(1, 2, "b1")
    assert resume.attempt == 2 and resume.start_step == 6
    assert {r.step for r in resume.records.values()} == {5}
    assert run.join(0, 2, "b0") == resume
    assert service.last_complete_step == 5
    status = run.status()
    assert status.state == "running" and status.attempt == 2 and status.versions_committed == 6
    (recovery,) = status.account["recoveries"]
    assert (recovery["t_fail"], recovery["resumed_at"]) == (5, 6) and status.account["failures"] == 1
    run.finish(True)
    assert run.status().state == "finished"


def test_a_group_grown_back_resumes_every_rank_at_the_same_step(store):
    """Shrunk to one worker after a loss, then grown back to two by Ray Train, whose new rank 1 may
    join before rank 0: both ranks get the new attempt's answer, at t_fail + 1."""
    writers = Writers()
    run, service = make(store, writers)
    run.join(0, 2, "a0")
    run.join(1, 2, "a1")
    train(service, range(1, 5))
    persist_all(run, store, 4)
    shrunk = run.join(0, 1, "b0")
    assert (shrunk.attempt, shrunk.start_step) == (2, 5)
    for step in range(5, 9):  # one rank now
        service.report(step=step, rank=0, lr=1e-3, abs_sums={n: 0.0 for n in LAYERS}, counts={n: 10 for n in LAYERS})
    grown = run.join(1, 2, "c1")
    assert (grown.attempt, grown.start_step) == (3, 9)
    assert run.join(0, 2, "c0") == grown
    recoveries = run.status().account["recoveries"]
    assert [(r["t_fail"], r["resumed_at"]) for r in recoveries] == [(4, 5), (8, 9)]


def _load(store, records):
    """What each rank's load reads (``load_composite`` through ``VersionReader``s): every element
    of every state of every layer, each tensor's checksum checked."""
    for record in records.values():
        with VersionReader(store, record) as reader:
            for key in STATE_KEYS:
                for name, shape in PARAMS.items():
                    reader.read(name, key, 0, math.prod(shape))


def test_a_resume_whose_load_finds_a_corrupt_tensor_is_retried_without_it_on_every_rank(store):
    """``--resume`` of a run stopped after step 5, whose only step-5 version (block.0's) has a byte
    flipped near the end of its data: the plan checks headers only and takes it; the load's read
    of that tensor fails. The rank reports the version and raises before any step was trained,
    which must not end the run as a setup error (a retry plans without the version); the retried
    group's ranks all get the same plan: block.0 from its previous version, and the resume step
    from the versions that plan accepts (step 4's), not from the rejected one."""
    for layer in LAYERS:
        write_layer(store, layer, 3, base=True)
    for layer in ("embed", "norm"):
        write_layer(store, layer, 4)
    bad, _ = write_layer(store, "block.0", 5)
    flip_data_byte(store, bad, rank=1)
    run, _ = make(store, Writers(), resume=True)
    first = run.join(0, 2, "a0")
    assert run.join(1, 2, "a1") == first and first.start_step == 6 and first.records["block.0"] == bad
    assert not run.worth_retrying()  # a rank that raises now, with nothing found, is a setup error
    with pytest.raises(CorruptShardError) as found:
        _load(store, first.records)
    assert found.value.version_id == bad.version_id
    run.version_unusable(found.value.version_id, str(found.value))  # train_fn.recover, before it raises
    assert not run.trained() and run.worth_retrying()
    again = run.join(1, 2, "b1")
    assert run.join(0, 2, "b0") == again and again.attempt == 2
    assert {layer: r.step for layer, r in again.records.items()} == {"embed": 4, "block.0": 3, "norm": 4}
    assert again.start_step == 5
    _load(store, again.records)  # every rank's load now succeeds
    assert not run.worth_retrying()  # the retry's plan skips it: nothing new to skip


def test_a_hung_writer_does_not_hang_recovery_and_its_versions_count_lost(store):
    writers = Writers(hung=("writer-0@node",))
    run, service = make(store, writers)
    run.join(0, 2, "a0")
    train(service, range(1, 6))
    persist_all(run, store, 3)
    persist_all(run, store, 5, writers)
    resume = run.join(0, 2, "b0")
    assert resume.start_step == 6 and {r.step for r in resume.records.values()} == {3}
    assert writers.replaced == ["writer-0@node"]
    status = run.status()
    assert status.lost_versions == 3 and status.abandoned_versions == 3


def test_a_failed_commit_is_retried_after_its_backoff(tmp_path):
    store, fs = faulty_store(str(tmp_path / "s"))
    waits = []

    def sleep(seconds):  # the storage comes back while the commit backs off
        waits.append(seconds)
        fs.read_only = False

    run, _ = make(store, Writers(), sleep=sleep)
    first, second = written_receipts(store, "norm", 4)
    run.shard_written(first, 0.01)
    fs.read_only = True
    run.shard_written(second, 0.01)
    status = run.status()
    assert waits == [0.5] and status.commit_retries == 1 and status.lost_versions == 0
    assert status.layers["norm"].last_step == 4 and [v.step for v in store.versions()] == [4]


def test_a_recovery_that_breaks_fails_the_join_instead_of_hanging_it(store):
    writers = Writers()
    run, service = make(store, writers)
    run.join(0, 2, "a0")

    def broken(deadline_s):
        raise ConnectionError("writer node unreachable")

    writers.drain = broken
    with pytest.raises(ConnectionError):
        run.join(0, 2, "b0")
    with pytest.raises(JoinDismissed, match="recovery failed"):
        run.join(1, 2, "b1")  # its group-mate is told at once, not left waiting
    writers.drain = lambda deadline_s: ()
    assert run.join(0, 2, "c0").attempt == 3  # the restarted group recovers


def test_survivors_captures_are_overlaid_and_the_account_says_where_each_element_came_from(store):
    from layercheck.orchestrator.core.accounting import format_sources

    writers = Writers()
    run, service = make(store, writers)
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    train(service, range(1, 6))
    persist_all(run, store, 3)
    captures = {}
    for layer in LAYERS:  # rank 0 survived step 5 and handed its slices over; rank 1 died
        state = layer_state(PARAMS, seed=50)
        shard = cut_shards(layer, 5, PARAMS, state, even_cuts(42, 2))[0]
        captures[layer] = store.write_shard(shard, origin="capture")
        run.shard_written(captures[layer], 0.01)  # its writer's receipt: the recovery commits it as a partial version
    resume = run.join(1, 2, "b1")
    assert resume.start_step == 6 and {r.step for r in resume.records.values()} == {3}
    assert {
        layer: [(o.partial, [s.path for s in o.shards]) for o in overlays]
        for layer, overlays in resume.overlays.items()
    } == {layer: [(True, [captures[layer].path])] for layer in LAYERS}
    account = run.status().account
    (recovery,) = account["recoveries"]
    assert recovery["sources"]["norm"] == [
        {
            "origin": "capture",
            "version_id": resume.overlays["norm"][0].version_id,
            "step": 5,
            "ranks": [0],
            "elements": 21,
            "partial": True,
        },
        {
            "origin": "policy",
            "version_id": resume.records["norm"].version_id,
            "step": 3,
            "ranks": [0, 1],
            "elements": 21,
            "partial": False,
        },
    ]
    assert (recovery["max_staleness"], recovery["weighted_staleness"]) == (2, 1.0)
    assert (
        recovery["elements"]
        == account["recovered_elements"]
        == {"capture": 63, "memory": 0, "stored": 63, "initial": 0}
    )
    assert format_sources(recovery["sources"]) == "capture@5 63 (3 layers); policy@3 63 (3 layers)"


def test_a_run_whose_lease_was_taken_over_commits_nothing_more_and_stops(tmp_path):
    """The driver was frozen past its lease (SIGSTOP), another run took the store over: the first
    run's next commit is refused before its record is written, and every rank is asked to stop."""
    from layercheck.orchestrator.store.fs import StoreFS
    from layercheck.orchestrator.store.layer_store import LayerStore
    from layercheck.orchestrator.store.lease import LEASE_LOST, StoreLease

    fs = StoreFS.open(str(tmp_path))
    ours = StoreLease.acquire(fs, run="first")
    store = LayerStore(fs)
    store.fence = ours.fence
    run, service = make(store, Writers())
    train(service, [1, 2])
    persist_all(run, store, 2)
    committed = {v.version_id for v in store.versions()}
    assert len(committed) == len(LAYERS)
    StoreLease.acquire(fs, run="second", take_over=True)  # (what --resume does once ours expired)
    persist_all(run, store, 3)
    assert {v.version_id for v in store.versions()} == committed, "a run without the lease committed"
    status = run.status()
    assert status.stop_reason.startswith(LEASE_LOST) and "second" in status.stop_reason
    assert run.lease_lost and service.stop_reason == status.stop_reason
    assert run.commits.commit_retries == 0, "a commit refused for a lost lease was retried"


class RebuiltPolicy(LocalPolicy):
    """A policy actor as the supervision sees it across a rebuild (``policy_actor.py``): after
    :meth:`rebuild` (its process died, Ray started a new one with the same arguments) its state is
    a fresh service's, and its count is unknown until the supervisor restarts it."""

    def __init__(self, service):
        super().__init__(service)
        self.lost_count = False

    def rebuild(self):
        self.service, self.lost_count = policy_service(), True

    def last_complete_step(self):
        return None if self.lost_count else super().last_complete_step()

    def restart(self, **kwargs):
        self.lost_count = False
        super().restart(**kwargs)


def progress(run, steps):
    """Rank 0's progress after each of ``steps``."""
    from layercheck.workers.progress import StepProgress

    for step in steps:
        run.progress(StepProgress(step=step, loss=1.0, lr=1e-3, compute_s=0.1, stall_s=0.0))


def make_rebuildable(store, writers):
    policy = RebuiltPolicy(policy_service())
    run = RunSupervisor(
        run_id="r",
        store=store,
        layer_numel=NUMEL,
        policy=policy,
        writers=writers,
        config=SupervisionConfig(drain_deadline_s=5.0, commit_backoff_s=0.5),
    )
    writers.run = run
    return run, policy


def test_a_group_whose_policy_actor_was_rebuilt_is_recovered_after_rank_0s_last_step(store):
    """The policy actor's process died after step 5 and Ray rebuilt it: its count is gone, and the
    group fails at its next answer. The new group is recovered after step 5, the last step rank 0
    reported (every rank passed its collectives), from what the store holds; the rebuilt actor is
    rebased there and decides the new group's steps; a stop the run had asked for still holds."""
    writers = Writers()
    run, policy = make_rebuildable(store, writers)
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    train(policy.service, range(1, 6))
    progress(run, range(1, 6))
    persist_all(run, store, 3)
    run.request_stop("interrupted (Ctrl-C)")
    policy.rebuild()
    resume = run.join(0, 2, "b0")
    assert run.join(1, 2, "b1") == resume
    assert (resume.attempt, resume.start_step) == (2, 6) and {r.step for r in resume.records.values()} == {3}
    (recovery,) = run.status().account["recoveries"]
    assert (recovery["t_fail"], recovery["resumed_at"]) == (5, 6)
    assert policy.last_complete_step() == 5 and policy.service.last_complete_step == 5  # rebased
    assert policy.service.stopping(6), "the rebuilt policy forgot the run's stop"
    train(policy.service, [6])
    assert policy.service.decision(6) is not None


def test_a_survivors_capture_one_step_past_rank_0s_last_report_is_taken_after_a_rebuild(store):
    """Rank 0 reported step 5; every rank then finished step 6 and failed reading the dead actor's
    answer, capturing its state at step 6: the recovery is at step 6, as after a lost peer."""
    writers = Writers()
    run, policy = make_rebuildable(store, writers)
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    train(policy.service, range(1, 6))
    progress(run, range(1, 6))
    persist_all(run, store, 3)
    for layer in LAYERS:  # each rank's slices at step 6 (both survived), as their writers hand them in
        state = layer_state(PARAMS, seed=60)
        for shard in cut_shards(layer, 6, PARAMS, state, even_cuts(42, 2)):
            run.shard_written(store.write_shard(shard, origin="capture"), 0.01)
    policy.rebuild()
    resume = run.join(0, 2, "b0", captured_step=6)
    assert resume.start_step == 7 and {(r.step, r.origin) for r in resume.records.values()} == {(6, "capture")}
    assert policy.service.last_complete_step == 6


def test_a_policy_actor_rebuilt_again_before_the_new_group_reports_recovers_at_the_same_step(store):
    """Rebuilt once, recovered after step 5; rebuilt again before the new group's rank 0 reported a
    step: the next recovery is again after step 5 (the rebase point), not after the lost group's steps."""
    writers = Writers()
    run, policy = make_rebuildable(store, writers)
    run.join(0, 2, "a0"), run.join(1, 2, "a1")
    train(policy.service, range(1, 8))
    progress(run, range(1, 8))
    persist_all(run, store, 5)
    run.join(0, 2, "b0", captured_step=None)  # a lost peer: recovered after step 7 (the policy's count)
    run.join(1, 2, "b1")
    policy.rebuild()
    third = run.join(0, 2, "c0")
    assert third.start_step == 8
    progress(run, [8, 9])
    policy.rebuild()
    assert run.join(0, 2, "d0").start_step == 10
