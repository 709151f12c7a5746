"""SIGTERM on ``layercheck train`` (``kill PID``, a scheduler stopping the job) is handled as
Ctrl-C is (tests/e2e/test_run_end_ray.py runs that end to end): it interrupts the driver's wait, the
run is asked to stop after the same step on every rank, and the stop says which signal it was."""

import os
import signal
import threading

import pytest

from layercheck.orchestrator.runtime.fit_watch import RunHandles, Terminated, fit_watched, raise_on_sigterm


@pytest.fixture
def sigterm_raises():
    before = raise_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_raises_like_ctrl_c(sigterm_raises):
    with pytest.raises(KeyboardInterrupt) as raised:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # (delivered by now; the handler runs in this thread)
    assert isinstance(raised.value, Terminated)


class _Supervisor:
    def __init__(self, fitted):
        self.fitted = fitted
        self.stops = []
        self.request_stop = self
        self.status = self

    def remote(self, *args):  # request_stop.remote(reason) / status.remote()
        import ray

        if args:
            self.stops.append(args[0])
            self.fitted.set()
        return ray.put({"state": "running", "step": 1, "account": {"history": {}}})


class _Trainer:
    def __init__(self, released):
        self.released = released

    def fit(self):
        self.released.wait(30)


@pytest.mark.slow
def test_the_run_is_asked_to_stop_naming_sigterm(local_ray):
    """(fit_watched installs the handler itself, after ray.init installed Ray's, and puts Ray's back.)"""
    before = signal.getsignal(signal.SIGTERM)
    released = threading.Event()
    supervisor = _Supervisor(released)
    handles = RunHandles(
        run_id="r",
        storage_uri="",
        policy_config=None,
        layer_numel={},
        policy=None,
        supervisor=supervisor,
        metrics_url=None,
        stop_drain_s=10,
    )
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    error = fit_watched(handles, _Trainer(released), poll_s=0.2)
    assert handles.interrupted and handles.interrupted_by == "SIGTERM"
    assert supervisor.stops == ["interrupted (SIGTERM)"] and error == "interrupted (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is before
