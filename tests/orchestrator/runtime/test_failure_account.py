"""LayerCheck's account of a lost worker stands out — one WARNING line when the
loss is seen and one when training resumes — and Ray's tracebacks on the driver's console are cut
to their last line (no Ray needed: the filter and the announcement are pure)."""

import logging

from layercheck.orchestrator.runtime.fit_watch import Announced, announce_failures
from layercheck.orchestrator.runtime.ray_noise import LogFilter
from tests.support.statuses import a_status

RAY_TRACEBACK = """Traceback (most recent call last):
  File "/x/ray/train/v2/_internal/execution/controller/controller.py", line 1, in _run
    raise WorkerGroupError(...)
    ^^^^^^^^^^^^^^^^^^^^^^^
  File "/x/ray/_private/worker.py", line 2, in get
    values = worker.get_objects(
The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/a.py", line 3, in f
ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
\tclass_name: RayTrainWorker
\tactor_id: 8d6c30f25145f2c31190bea501000000
The actor may have been killed by the OOM killer: see ray logs for memory usage
Started training worker group of size 2:""".splitlines()


def test_a_traceback_is_cut_to_its_last_line_and_known_noise_dropped():
    f = LogFilter()
    kept = f.filter(4242, RAY_TRACEBACK[:5]) + f.filter(4242, RAY_TRACEBACK[5:])  # split across batches
    assert kept[0].startswith("ray.exceptions.ActorDiedError: The actor died unexpectedly")
    assert "traceback lines cut" in kept[0]
    assert kept[1:] == ["Started training worker group of size 2:"]
    assert f.dropped == len(RAY_TRACEBACK) - 2


def test_ray_trains_worker_repr_and_truncated_snippets_are_cut():
    f = LogFilter()
    lines = [
        "[Rank 0 Error Snippet]:",
        "Traceback (most recent call last):",
        '  File "a.py", line 1',
        "... (Output truncated. See individual worker logs for full details) ...",
        "eturn func(*args)",
        "    work.wait()",
        "RuntimeError: Connection reset by peer",
        "",
        "[Rank 1 Error Snippet]:",
        "Worker info: Worker(",
        "  actor=Actor(RayTrainWorker, cd),",
        ")",
        "The actor died unexpectedly before finishing this task.",
    ]
    kept = f.filter(7, lines)
    assert [k.split("  [")[0] for k in kept] == [
        "[Rank 0 Error Snippet]:",
        "RuntimeError: Connection reset by peer",
        "",
        "[Rank 1 Error Snippet]:",
        "The actor died unexpectedly before finishing this task.",
    ]


def test_ray_trains_echo_of_each_report_is_dropped():
    line = (
        "Reporting training result 8: TrainingReport(checkpoint=None, metrics={'step': 90, 'loss': 3.45}, "
        "validation=False) from rank 0"
    )
    f = LogFilter()
    assert f.filter(3, [line, "[running] step 96  loss 3.074"]) == ["[running] step 96  loss 3.074"]


def test_other_lines_pass_untouched_and_sources_are_kept_apart():
    f = LogFilter()
    assert f.filter(1, ["Traceback (most recent call last):", '  File "a.py"']) == []
    assert f.filter(2, ["WARNING layercheck.orchestrator.runtime.train_fn: fault injection: rank 1 kills itself"]) == [
        "WARNING layercheck.orchestrator.runtime.train_fn: fault injection: rank 1 kills itself"
    ]
    assert f.filter(1, ["ValueError: x"])[0].startswith("ValueError: x")


def test_a_lost_group_and_its_recovery_are_announced_once_each(caplog):
    seen = Announced()
    recovery = {"resumed_at": 9, "t_fail": 8, "max_staleness": 3, "steps_redone": 0}
    with caplog.at_level(logging.WARNING):
        assert announce_failures(a_status(state="running", step=8, account={"recoveries": []}, attempt=2), seen) == []
        (lost,) = announce_failures(
            a_status(state="recovering", step=8, account={"recoveries": []}, attempt=2),
            seen,
            "injected: rank 1 SIGKILLs itself after step 8, fault.kill_at_step",
        )
        assert (
            announce_failures(a_status(state="recovering", step=8, account={"recoveries": []}, attempt=2), seen) == []
        )
        (resumed,) = announce_failures(
            a_status(state="running", step=9, account={"recoveries": [recovery]}, attempt=2), seen
        )
        assert (
            announce_failures(a_status(state="running", step=10, account={"recoveries": [recovery]}, attempt=2), seen)
            == []
        )
    assert lost.startswith("LAYERCHECK: worker group lost after step 8 (injected: rank 1")
    assert resumed.startswith("LAYERCHECK: recovered: training resumes at step 9")
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]


def test_a_recovery_over_between_two_polls_is_announced_in_one_line():
    seen = Announced()
    recovery = {"resumed_at": 9, "t_fail": 8, "max_staleness": 3, "steps_redone": 0}
    (line,) = announce_failures(
        a_status(state="running", step=9, account={"recoveries": [recovery]}, attempt=2), seen, "rank 1"
    )
    assert line.startswith("LAYERCHECK: worker group lost after step 8 (rank 1); recovered: training resumes at step 9")


def test_a_grown_group_is_announced_as_a_grow_not_a_loss():
    seen = Announced(state="running", recoveries=1)
    grown = {"resumed_at": 124, "t_fail": 123, "max_staleness": 3, "steps_redone": 0, "world_size": 2, "grown_from": 1}
    recovering = a_status(
        state="recovering", step=123, world_size=2, grown_from=1, account={"recoveries": [{}]}, attempt=2
    )
    (growing,) = announce_failures(recovering, seen)
    (resumed,) = announce_failures(
        a_status(state="running", step=124, account={"recoveries": [{}, grown]}, attempt=2), seen
    )
    assert growing.startswith("LAYERCHECK: Ray Train grows the worker group from 1 to 2 workers after step 123")
    assert resumed.startswith("LAYERCHECK: resumed with 2 workers (was 1): training resumes at step 124")


def test_a_resume_is_announced_as_a_resume_not_as_a_lost_group(caplog):
    """``--resume`` plans its composite in attempt 1: no group was lost, nothing was injected."""
    seen = Announced()
    resume = {"resumed_at": 41, "t_fail": 40, "max_staleness": 0, "steps_redone": 0, "world_size": 1, "kind": "resume"}
    note = "injected: rank 0 SIGKILLs itself after step 20, fault.kill_at_step"
    planning = a_status(state="recovering", attempt=1, step=0, account={"recoveries": []})
    assert announce_failures(planning, seen, note) == []
    (line,) = announce_failures(
        a_status(state="running", step=41, account={"recoveries": [resume]}, attempt=2), seen, note
    )
    assert (
        line == "LAYERCHECK: --resume: the stored run continues at step 41 with 1 worker(s); composite staleness max 0"
    )
