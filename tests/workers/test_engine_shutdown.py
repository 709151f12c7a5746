"""Releasing a DeepSpeed engine on the way out (workers/engine.py ``shutdown``): where a lost group's
teardown has destroyed the process group first, the release's own error does not replace the
error the rank leaves with; with the group still up, a release that fails says so."""

from __future__ import annotations

import pytest
import torch

from layercheck.workers import engine
from layercheck.workers.engines.deepspeed import DeepSpeedAdapter


class _Engine:
    """A DeepSpeedEngine whose ``destroy`` fails."""

    basic_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    zero_optimization_stage = module = None

    def __init__(self, error: Exception) -> None:
        self.error = error

    def destroy(self) -> None:
        raise self.error


class _TrainEngine:
    def __init__(self, error: Exception) -> None:
        self.adapter = DeepSpeedAdapter(_Engine(error))


def test_a_release_that_fails_because_the_group_is_gone_does_not_hide_the_rank_s_own_error(monkeypatch):
    left: list[bool] = []
    monkeypatch.setattr(engine, "leave_group", lambda: left.append(True))
    gone = AssertionError("DeepSpeed backend not set, please initialize it using init_process_group()")
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        try:
            raise RuntimeError("gloo: Connection reset by peer")
        finally:
            engine.shutdown(_TrainEngine(gone))  # the group was destroyed under it
    assert left == [True]


def test_with_the_group_up_a_failing_release_raises(monkeypatch):
    monkeypatch.setattr(engine, "leave_group", lambda: torch.distributed.destroy_process_group())
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    with pytest.raises(ValueError, match="broken release"):
        engine.shutdown(_TrainEngine(ValueError("broken release")))
    assert not torch.distributed.is_initialized()  # the group is left all the same
