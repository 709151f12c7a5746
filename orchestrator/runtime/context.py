"""What a worker of a user's own Ray Train loop needs to know about its LayerCheck run.

``layercheck.LayerCheckTrainer`` wraps the user's ``train_loop_per_worker`` so that, inside each
worker, the run's :class:`WorkerContext` is current while the user's function runs; the user's
``layercheck.attach(engine)`` reads it to find the run's actors and storage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from layercheck.orchestrator.core.run_config import FaultConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    run_id: str
    """Names the run's actors (see :class:`layercheck.orchestrator.runtime.names.RunNames`)."""
    storage_uri: str
    fsync: bool
    max_inflight_bytes: int
    fault: FaultConfig
    drift_probe: str
    layer_map: Any
    """The user's layer-map spec (dict or callable), or ``None``: by parameter names."""
    layer_numel: Mapping[str, int]
    """Per layer, the parameter count the driver computed: the workers' model must match it."""
    save_final: bool = True
    """``lc.finish()`` persists every layer's state at the last step (``persistence.save_final``)."""
    capture_timeout_s: float | None = None
    """A survivor's capture when the loop raises (``persistence.capture``); ``None``: off."""
    memory_period: int = 0
    """Steps between memory versions (``persistence.memory_period``; 0: none)."""
    policy: Any = None
    """The run's policy config (``CheckpointConfig.policy``), for the warnings a worker can give
    once it knows how many steps the loop will train."""
    in_place: bool = False
    """A lost peer does not end this worker: it runs the loop again in a new process group
    (``CheckpointConfig.in_place``; :func:`layercheck.orchestrator.runtime.in_place.train_in_place`)."""
    regroup_timeout_s: float = 600.0
    stop_drain_s: float = 120.0
    """How long ``lc.finish()`` waits for this rank's last snapshots to be written (``persistence.stop_drain_s``:
    the driver's final drain counts what is not written by then as lost)."""


@dataclass
class Incarnation:
    """This worker's current run of the user's loop: the first, or one after an in-place recovery."""

    number: int = 0
    """0: the process's first; n: its n-th recovery in place (it kept its process)."""
    group_s: float = 0.0
    """Forming its process group once every rank was there (in place; else Ray Train's, not timed)."""
    attached: bool = False
    """``attach`` returned: the loop trains (an error from here on is no failed recovery)."""

    def worker_id(self, base: str) -> str:
        """The id the supervisor knows this run of the loop by (a new one per incarnation)."""
        return base if self.number == 0 else f"{base}/{self.number}"


_current: WorkerContext | None = None
_on_failure: list[Callable[[BaseException], None]] = []
_loop_started_at: float | None = None
_incarnation = Incarnation()


def process_started_at() -> float:
    """When this worker process started (wall clock): its imports, Ray Train's context and the
    process group come between this and the train function."""
    import psutil  # type: ignore[import-untyped]  # (a DeepSpeed dependency, without type stubs)

    return float(psutil.Process().create_time())


def loop_started_at() -> float | None:
    """When the user's loop (the ``train_loop_per_worker``) started, inside a LayerCheck run."""
    return _loop_started_at


def current() -> WorkerContext | None:
    """The context of the LayerCheck run this worker belongs to, if any."""
    return _current


def incarnation() -> Incarnation:
    """This worker's current run of the user's loop."""
    return _incarnation


def on_failure(hook: Callable[[BaseException], None]) -> None:
    """Run ``hook(error)`` if the user's loop raises (``layercheck.attach`` registers the survivor
    capture here, so a loop that never calls ``finish`` or uses ``with`` still captures)."""
    _on_failure.append(hook)


def call_with_context(fn: Callable[..., Any], context: WorkerContext, *args: Any) -> Any:
    """Call ``fn(*args)`` with ``context`` current (Ray Train runs one loop per worker process);
    in place, again after each lost peer, in a new process group. DeepSpeed is imported first
    (:func:`~layercheck.workers.engine.warm_engine_imports`), so that the engine the loop builds
    does not import torch's inductor for DeepSpeed's Muon: ~2 s of CPU less per worker start."""
    global _current
    from layercheck.workers.engine import warm_engine_imports

    warm_engine_imports()
    previous, _current = _current, context
    try:
        if not context.in_place:
            return _call_once(fn, args)
        from layercheck.orchestrator.runtime.in_place import train_in_place

        return train_in_place(lambda: _call_once(fn, args), context, _start_incarnation)
    finally:
        _current = previous


def _start_incarnation(number: int, group_s: float) -> Incarnation:
    global _incarnation
    _incarnation = Incarnation(number=number, group_s=group_s)
    return _incarnation


def _call_once(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """One run of the user's loop: the failure hooks (``attach``'s capture) run if it raises."""
    global _loop_started_at
    _loop_started_at = time.time()
    try:
        return fn(*args)
    except Exception as error:
        for hook in _on_failure:
            hook(error)
        raise
    finally:
        _on_failure.clear()


def with_context(fn: Callable[..., Any], context: WorkerContext, *, takes_config: bool) -> Callable[..., Any]:
    """``fn`` wrapped for Ray Train: the wrapper takes a config argument exactly when ``fn`` does
    (Ray Train looks at the signature to decide whether to pass ``train_loop_config``)."""
    loop: Callable[..., Any]
    if takes_config:

        def loop(config: Any) -> Any:
            return call_with_context(fn, context, config)
    else:

        def loop() -> Any:
            return call_with_context(fn, context)

    loop.__name__ = getattr(fn, "__name__", "train_loop_per_worker")
    return loop
