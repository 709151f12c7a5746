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

from layercheck.orchestrator.core.accounting import RankStart
from layercheck.orchestrator.core.run_config import FaultConfig
from layercheck.policies.configs import PolicyConfig
from layercheck.policies.layer_map import LayerMapSpec

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
    layer_map: LayerMapSpec | None
    """The user's layer-map spec (dict or callable), or ``None``: by parameter names."""
    layer_numel: Mapping[str, int]
    """Per layer, the parameter count the driver computed: the workers' model must match it."""
    save_final: bool = True
    """``lc.finish()`` persists every layer's state at the last step (``persistence.save_final``)."""
    capture_timeout_s: float | None = None
    """A survivor's capture when the loop raises (``persistence.capture``); ``None``: off."""
    memory_period: int = 0
    """Steps between memory versions until a decision carries the run's (``persistence.memory_period``;
    0: none, or ``"auto"``: the decisions carry the period the run chose)."""
    policy: PolicyConfig | None = None
    """The run's policy config (``CheckpointConfig.policy``), for the warnings a worker can give
    once it knows how many steps the loop will train."""
    in_place: bool = False
    """A lost peer does not end this worker: it runs the loop again in a new process group
    (``CheckpointConfig.in_place``; :func:`layercheck.orchestrator.runtime.in_place.train_in_place`)."""
    spares: int = 0
    """``in_place``: warm spares beside the training ranks (``CheckpointConfig.spares``): Ray Train's
    world holds them too, and the supervisor's roster says which worker trains which rank."""
    regroup_timeout_s: float = 600.0
    decision_timeout_s: float = 600.0
    """How long a rank waits for a step's decision before it names the ranks that never reported
    the step and fails (``persistence.decision_timeout_s``)."""
    stop_drain_s: float = 120.0
    """How long ``lc.finish()`` waits for this rank's last snapshots to be written (``persistence.stop_drain_s``:
    the driver's final drain counts what is not written by then as lost)."""


@dataclass
class Incarnation:
    """This worker's current run of the user's loop: the first, or one after an in-place recovery."""

    number: int = 0
    """0: the process's first; n: its n-th recovery in place (it kept its process)."""
    spare: bool = False
    """A warm spare's run of the loop (``CheckpointConfig.spares``): it ran while the spare waited
    for a rank, and goes on as the rank it was promoted to."""
    counted_from: float = 0.0
    """When this run's own work began (wall clock): the loop's start; a spare's promotion (what it
    did before, it did while idle)."""
    waited_s: float = 0.0
    """Of the time since ``counted_from``, the wait for the other ranks to form the process group
    with (theirs to spend: a replacement's start, say)."""
    group_s: float = 0.0
    """Forming its process group once every rank was there (in place; else Ray Train's, not timed)."""
    leave_s: float = 0.0
    """A rerun's: from the last run's error to this run's start (its capture, release, leaving the group)."""
    failed_at: float = 0.0
    """When this run of the loop raised (wall clock; 0: it has not)."""
    attached: bool = False
    """``attach`` returned: the loop trains (an error from here on is no failed recovery)."""

    def worker_id(self, base: str) -> str:
        """The id the supervisor knows this run of the loop by (a new one per incarnation)."""
        return base if self.number == 0 else f"{base}/{self.number}"

    def rank_start(self, rank: int, now: float) -> RankStart:
        """How this run of the loop got to ``attach`` at ``now``, for the recovery's timeline: the
        process start (a new process's first run only), the group's forming, and the loop's own work
        since ``counted_from`` (the model, the engine) less the waits for the others."""
        if not self.counted_from:  # not a run of the loop this module started: nothing to time
            return RankStart(rank=rank, kept_process=self.number > 0, spare=self.spare)
        cold = self.number == 0 and not self.spare
        return RankStart(
            rank=rank,
            start_s=max(0.0, self.counted_from - process_started_at()) if cold else 0.0,
            group_s=self.group_s,
            build_s=max(0.0, now - self.counted_from - self.waited_s - self.group_s),
            leave_s=self.leave_s,
            waited_s=self.waited_s,
            kept_process=self.number > 0,
            spare=self.spare,
        )


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


def call_with_context(fn: Callable[..., object], context: WorkerContext, *args: object) -> object:
    """Call ``fn(*args)`` with ``context`` current (Ray Train runs one loop per worker process);
    in place, again after each lost peer, in a new process group formed when the loop first needs
    it, and on a warm spare as far as the loop goes before it needs its rank
    (:func:`~layercheck.orchestrator.runtime.in_place.train_in_place`). DeepSpeed is imported first
    (:func:`~layercheck.workers.engine.warm_engine_imports`), so that the engine the loop builds
    does not import torch's inductor for DeepSpeed's Muon: ~2 s of CPU less per worker start."""
    global _current
    # (imported here: torch and DeepSpeed, which the driver, importing this module too, never needs)
    from layercheck.workers.engine import warm_engine_imports

    warm_engine_imports()
    previous, _current = _current, context
    try:
        if not context.in_place:
            _start_incarnation(0, spare=False)
            return _call_once(fn, args)
        from layercheck.orchestrator.runtime.in_place import train_in_place  # (as above: it imports torch)

        return train_in_place(lambda: _call_once(fn, args), context, _start_incarnation)
    finally:
        _current = previous


def _start_incarnation(number: int, spare: bool) -> Incarnation:
    global _incarnation
    failed_at = _incarnation.failed_at if number else 0.0
    _incarnation = Incarnation(number=number, spare=spare, leave_s=time.time() - failed_at if failed_at else 0.0)
    return _incarnation


def _call_once(fn: Callable[..., object], args: tuple[object, ...]) -> object:
    """One run of the user's loop: the failure hooks (``attach``'s capture) run if it raises."""
    global _loop_started_at
    _loop_started_at = time.time()
    _incarnation.counted_from = _loop_started_at  # (a spare's promotion, later, moves it on)
    try:
        return fn(*args)
    except Exception as error:
        _incarnation.failed_at = time.time()
        for hook in _on_failure:
            hook(error)
        raise
    finally:
        _on_failure.clear()


def with_context(fn: Callable[..., object], context: WorkerContext, *, takes_config: bool) -> Callable[..., object]:
    """``fn`` wrapped for Ray Train: the wrapper takes a config argument exactly when ``fn`` does
    (Ray Train looks at the signature to decide whether to pass ``train_loop_config``)."""
    loop: Callable[..., object]
    if takes_config:

        def loop(config: object) -> object:
            return call_with_context(fn, context, config)
    else:

        def loop() -> object:
            return call_with_context(fn, context)

    loop.__name__ = getattr(fn, "__name__", "train_loop_per_worker")
    return loop
