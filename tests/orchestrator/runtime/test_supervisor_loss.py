"""A lost supervisor (the writers die with it) ends the run with one line and the way to continue
it: the driver's poll sees it and asks the ranks, through the policy actor, to stop after the same
step; Ray Train's controller ends the run instead of restarting a group that could not join; the
driver's end reports what its last poll and the store know; ``layercheck train`` prints the resume
command. Each piece here with a fake actor at the exact call that finds the supervisor dead; the
whole of it on a real Ray: ``tests/e2e/test_control_plane_loss.py``."""

from __future__ import annotations

import argparse
import threading
from typing import Any

import pytest
import ray

from layercheck.orchestrator.cli import train as train_cli
from layercheck.orchestrator.runtime import driver, run_end
from layercheck.orchestrator.runtime.fit_watch import RunHandles, _watch
from layercheck.orchestrator.runtime.setup_errors import SetupErrorsEndTheRun
from layercheck.orchestrator.runtime.supervisor_loss import SupervisorLost, lost_reason
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE
from layercheck.policies.configs import IntervalConfig
from tests.support.statuses import a_status

NUMEL = {"embed": 10, "norm": 2}
STATUS = a_status(state="running", step=6, loss=2.5, account={"history": {}})


class _Call:
    """``actor.method`` of a fake actor: ``.remote(*args)`` records the call and returns its answer."""

    def __init__(self, actor: _Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> tuple[_Actor, str]:
        self.actor.calls.append((self.name, args))
        return (self.actor, self.name)


class _Actor:
    def __init__(self, answers: dict[str, Any] | None = None, *, dead: bool = False) -> None:
        self.answers = answers or {}
        self.dead = dead
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> _Call:
        return _Call(self, name)


def _get(ref: tuple[_Actor, str], timeout: float | None = None) -> Any:
    actor, name = ref
    if actor.dead:
        raise ray.exceptions.ActorDiedError()
    return actor.answers.get(name)


def _handles(supervisor: _Actor, policy: _Actor, storage: str = "") -> RunHandles:
    return RunHandles(
        run_id="r",
        storage_uri=storage,
        policy_config=IntervalConfig(interval=1),
        layer_numel=dict(NUMEL),
        policy=policy,
        supervisor=supervisor,
        metrics_url=None,
        stop_drain_s=5,
    )


def test_the_drivers_poll_that_finds_the_supervisor_dead_asks_every_rank_to_stop_once(monkeypatch, caplog):
    monkeypatch.setattr(ray, "get", _get)
    supervisor, policy = _Actor({"status": STATUS}), _Actor()
    handles = _handles(supervisor, policy)
    stop = threading.Event()
    polls = iter([False, True])  # alive at the first poll, dead at the second

    def poll_s_later(seconds: float) -> bool:
        supervisor.dead = next(polls, True)
        return False

    monkeypatch.setattr(stop, "wait", poll_s_later)
    _watch(handles, None, stop, 0.0)  # returns once it saw the death
    assert handles.last_status == STATUS
    assert handles.supervisor_lost == lost_reason(6) and "\n" not in handles.supervisor_lost
    assert "the last step it reported: 6" in handles.supervisor_lost
    assert policy.calls == [("request_stop", (handles.supervisor_lost,))]
    assert [r.message for r in caplog.records if "LAYERCHECK" in r.message] == [f"LAYERCHECK: {lost_reason(6)}"]


def test_ray_trains_controller_ends_the_run_when_the_supervisor_is_dead_and_retries_when_it_is_only_slow(
    monkeypatch,
):
    monkeypatch.setattr(ray, "get", _get)
    callback = SetupErrorsEndTheRun(_Actor(dead=True))
    with pytest.raises(SupervisorLost, match="supervisor actor died"):
        callback.after_exception(None, {0: ray.exceptions.ActorDiedError()})

    def slow(ref: Any, timeout: float | None = None) -> Any:
        raise ray.exceptions.GetTimeoutError("busy")

    monkeypatch.setattr(ray, "get", slow)
    assert callback.after_exception(None, {0: ray.exceptions.ActorDiedError()}) is None  # Ray Train retries


def test_the_drivers_end_without_a_supervisor_is_one_line_with_what_its_last_poll_and_the_store_know(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(ray, "get", _get)
    monkeypatch.setattr(run_end, "kill", lambda actor: None)  # (fake actors: nothing to kill)
    trace = {"steps": [{"step": 5, "lr": 1e-3, "drift": {"embed": 1e-4, "norm": 1e-5}}]}
    supervisor, policy = _Actor(dead=True), _Actor({"trace": trace, "schedule_view": {"peak_step_bytes": 0}})
    handles = _handles(supervisor, policy, str(tmp_path))
    handles.last_status = STATUS
    raised = "WorkerGroupError: Worker group failed\nTraceback (most recent call last):\n  ..."
    result = run_end.finish_run(handles, error=raised, config=None)
    assert result.error == result.supervisor_lost == lost_reason(6)
    assert result.status["state"] == "failed" and result.status["step"] == 6
    assert result.status["stored"]["newest_recoverable_step"] is None  # nothing committed in this store
    assert [o.step for o in result.trace.steps] == [5] and (tmp_path / DRIFT_TRACE_FILE).exists()
    assert not [name for name, _ in supervisor.calls if name not in ("status",)]  # nothing more asked of it
    assert result.end_errors == []


def test_layercheck_train_prints_the_one_line_reason_and_the_resume_command(monkeypatch, capsys):
    from layercheck.orchestrator.core.run_config import load_run_config

    config = load_run_config("examples/demo.toml", {"metrics.port": 0})
    reason = lost_reason(6)
    lost = run_end.RunResult(
        run_id="r",
        config=config,
        status={},
        trace=None,  # type: ignore[arg-type]  (the summary of an unknown state reads no trace)
        layer_numel=dict(NUMEL),
        error=reason,
        supervisor_lost=reason,
    )
    monkeypatch.setattr(driver, "train", lambda *args, **kwargs: lost)
    args = argparse.Namespace(config="examples/demo.toml", set=["steps=12"], restart_into=None)
    status = train_cli.train_and_report(
        config, overwrite=False, as_json=False, resume_command=train_cli.resume_command(args)
    )
    out, err = capsys.readouterr()
    assert status == 1
    assert f"unknown ({reason})" in out and "Traceback" not in out + err and "WorkerGroupError" not in out + err
    assert err.strip().splitlines()[-2:] == [
        f"{reason}. To continue this run from its newest recoverable step:",
        "  layercheck train examples/demo.toml --set steps=12 --resume",
    ]
