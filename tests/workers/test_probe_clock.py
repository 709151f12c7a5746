"""The drift probe's clock (workers/drift/clock.py): the time of the spans a probe opens around its
own work, by the wall clock on CPU and by CUDA events on a GPU, read once the device has passed
them (never a synchronisation of its own)."""

from __future__ import annotations

import time

import pytest
import torch

from layercheck.workers.drift import clock as probe_clock
from layercheck.workers.drift.clock import ProbeClock
from tests.support.devices import devices, require


@pytest.mark.parametrize("device", devices())
def test_the_clock_hands_over_each_spans_time_once(device):
    dev = require(device)
    clock = ProbeClock()
    assert clock.take() == 0.0  # nothing opened: nothing to say
    x = torch.randn(256, 256, device=dev)
    started = time.perf_counter()
    for _ in range(3):
        with clock.span(dev):
            for _ in range(20):
                x = x @ x / 256
    if dev.type == "cuda":
        torch.cuda.synchronize()  # (the clock itself never waits: a span counts once the device passed it)
    spent = time.perf_counter() - started
    seconds = clock.take()
    assert 0 < seconds <= spent
    assert clock.take() == 0.0  # handed over once


def test_time_outside_the_spans_is_not_counted(monkeypatch):
    readings = iter([10.0, 11.0, 15.0, 17.5])  # two spans, 1 s and 2.5 s, 4 s apart
    monkeypatch.setattr(probe_clock.time, "perf_counter", lambda: next(readings))
    clock = ProbeClock()
    for _ in range(2):
        with clock.span(torch.device("cpu")):
            pass
    assert clock.take() == 3.5
