"""The run's policy actor: one per run, named, asynchronous.

Every rank calls :meth:`PolicyActor.report` after each optimizer step without waiting for the
answer; the call resolves once all ranks have reported that step, with the one decision they
all follow. Ranks collect step ``t``'s decision after step ``t + 1`` (the pipeline lag,
:data:`layercheck.workers.loop.DECISION_LAG`), by which time every rank has long reported ``t``,
so the training loop does not wait on the actor. A measured step's answer also carries the
decisions of the quiet steps after it (:meth:`PolicyService.plan`): a rank holding them collects
no answer on those steps.

Ray does not run an asynchronous actor's calls in the order one caller made them: it ran a rank's
report of step 2 before its report of step 1, so step 2 completed first, step 1 never did, and the
other rank waited for step 1's decision for good. So each rank's reports are taken in here in step
order: a report waits until the same rank's report of the step before is in.

The write budget (``persistence.write_budget``): each writer actor pushes its running totals
(bytes written, seconds spent writing) here after every write, fire-and-forget, and the actor
times the steps itself (the interval between completed steps), so nothing is added to the ranks'
per-step path; :class:`~layercheck.orchestrator.core.persistence.write_budget.DrainBudget` turns them into the budget
the next steps' observations carry. The actor also keeps the most bytes one step's decision
handed over (the run's peak), for the summary and the metrics.

**A rebuilt actor.** The driver starts this actor with ``max_restarts`` (:data:`MAX_RESTARTS`):
when its process dies (SIGKILL, OOM), Ray starts a new one with the same arguments, under the same
name and handles. Its state died with the old process: the drift accumulated since each layer's
last save, the decisions and plans already handed out, which ranks reported which step. So a
rebuilt actor decides nothing until the supervisor restarts it for the next worker group: it
answers every report with a refusal (the rank raises :class:`PolicyActorLost`, as it does when its
call died with the old process) and its ``last_complete_step`` is ``None`` (unknown: the
supervisor recovers after rank 0's last reported step instead). The group fails, Ray Train restarts
it, and the existing recovery rebuilds the state: the composite from the store and the survivors'
captures, the policy rebased on the versions it loaded, every rank resuming at ``t_fail + 1``. Why
every rank gets the same decision for every step: a step's decision comes from one process only.
Steps up to the death were decided by the old one (a rank that read one and a rank whose call
died may differ in what they *did*, never in what they were told; the version only the first one
handed over stays partial, as a lost peer's would), and the rebuilt one decides only the steps of
the group started after its restart. Re-deriving the old answers instead would need the old
process's drift totals, which no other process holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from layercheck.orchestrator.core.persistence.write_budget import DrainBudget, StepClock, WriteBudgetConfig
from layercheck.orchestrator.core.policy_service import PolicyService
from layercheck.orchestrator.logs import configure_process_logging
from layercheck.policies.checkpoint_policy import build_policy
from layercheck.policies.configs import PolicyConfig
from layercheck.policies.decision import PersistDecision
from layercheck.policies.staggered import BYTES_PER_PARAM
from layercheck.policies.trace import observation_json

logger = logging.getLogger(__name__)

#: The longest a rank's report waits for the rank's report of the step before (see the module).
REPORT_ORDER_WAIT_S = 30.0
#: Ray restarts a dead policy actor this often (-1: always). Each rebuild costs the run the worker
#: group it fails, one of ``cluster.max_failures``, which bounds them.
MAX_RESTARTS = -1
#: The supervisor's calls that a recovery waits on, retried on the rebuilt actor (each gives the same
#: result twice). A rank's report is not: the old process's answer is gone.
_RETRIED = ray.method(max_task_retries=-1)
#: Calls the actor runs at once. Every rank's report of a step waits in the actor until the last
#: rank's is in, and a rank reports the steps after it meanwhile (the quiet steps' decisions ride on
#: the measured step's answer): with Ray's default (1000), at 1,024 ranks the reports the actor had
#: taken in waited for ranks whose reports it would never take in, and every rank waited for a
#: decision for good (``bench/scale``, ``test_many_ranks.py``). A waiting report costs a coroutine.
MAX_CALLS = 1_000_000


class PolicyActorLost(RuntimeError):
    """A rank's report was answered by no live policy actor (its process died, or was rebuilt and
    not restarted yet): this rank's group fails and is recovered, as after a lost peer."""


def _was_rebuilt() -> bool:
    """Whether Ray restarted this actor's process (``max_restarts``); False outside an actor."""
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return False
    with warnings.catch_warnings():  # (Ray 2.60's property reads its own deprecated ``actor_id``)
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(context.was_current_actor_reconstructed)


# ray.remote's typed keyword form lists task options only, not an actor's max_concurrency (which Ray takes)
@ray.remote(num_cpus=0, max_concurrency=MAX_CALLS)  # type: ignore[call-overload]
class PolicyActor:
    def __init__(
        self,
        config: PolicyConfig,
        numel: Mapping[str, int],
        world_size: int,
        max_versions_in_flight: int = 1,
        write_budget: WriteBudgetConfig | None = None,
        memory_period: int | None = None,
    ) -> None:
        """``memory_period``: the memory versions' period the decisions carry to the ranks
        (``persistence.memory_period = "auto"``: the run's first, until the supervisor has chosen
        one, :meth:`set_memory_period`; a rebuilt actor starts at it again and the supervisor
        tells it the chosen one at its restart); ``None``: the ranks keep the period they were set."""
        configure_process_logging()  # the actor process has no main of ours
        self.service = PolicyService(
            build_policy(config, numel),
            list(numel),
            world_size,
            max_versions_in_flight=max_versions_in_flight,
            drift_every=config.drift_every,
            memory_period=memory_period,
        )
        self._ready: dict[int, asyncio.Event] = {}
        self._taken: dict[int, int] = {}
        """Per rank, the last step whose report was taken in (since the group started)."""
        self._first_step = 1
        """The step the current group's ranks report first."""
        self._group = 0
        """Counts the groups (a restart begins the next): a report held for a lost group is dropped."""
        self._took = asyncio.Event()  # set (and replaced) whenever a report is taken in or a group starts
        self._plans: dict[int, list[dict[str, Any]]] = {}  # per completed step, the quiet steps' decisions after it
        self._layer_bytes = {name: int(n) * BYTES_PER_PARAM for name, n in numel.items()}
        self.peak_step_bytes = 0
        self.peak_step: int | None = None
        self.handed_bytes = 0
        """What the schedule's decisions handed over in all (12 bytes a parameter; the final save is none)."""
        budget = write_budget if write_budget is not None and write_budget.enabled else None
        self._drain = DrainBudget(budget) if budget is not None else None
        self._clock = StepClock(budget.ema if budget is not None else 0.0)
        self.rebuilt = _was_rebuilt()
        """Ray restarted this actor and the supervisor has not restarted it since: it knows nothing of the run."""
        if self.rebuilt:
            logger.error(
                "the policy actor's process died and Ray started this one: it refuses the current group's "
                "reports (the group is recovered) until the supervisor restarts it for the next group"
            )

    async def report(
        self,
        step: int,
        rank: int,
        lr: float,
        abs_sums: Mapping[str, float],
        counts: Mapping[str, int],
        measured: bool = True,
    ) -> dict[str, object] | None:
        """This rank's drift for ``step`` (``measured`` false: none measured, ``drift_every``);
        returns the step's decision (as JSON) once all ranks are in, or ``None`` if the worker
        group was restarted before they were; ``{"refused": why}`` from a rebuilt actor."""
        if self.rebuilt:
            return {
                "refused": f"the policy actor was rebuilt after its process died; rank {rank}'s step {step} is undecided"
            }
        group = self._group
        if not await self._in_turn(rank, step, group):
            return None  # held for a group that was lost meanwhile
        self._taken[rank] = max(step, self._taken.get(rank, 0))
        self._advance()
        completed = step > self.service.last_complete_step
        if not completed and self.service.decision(step) is None:
            # no rank will ever complete this step again, so waiting would hang this rank for good
            # (and its group-mates at the next collective): fail the group loudly instead
            raise RuntimeError(
                f"rank {rank} reported step {step}, but the run completed step "
                f"{self.service.last_complete_step} already and step {step}'s decision is gone: this rank "
                "is not on the run's steps (its group's ranks resumed at different steps?)"
            )
        decision = self.service.report(step=step, rank=rank, lr=lr, abs_sums=abs_sums, counts=counts, measured=measured)
        event = self._ready.setdefault(step, asyncio.Event())
        if decision is not None:
            if completed:  # this call completed the step (not a late duplicate)
                self._completed(decision)
            event.set()
        await event.wait()
        self._forget_before(self.service.last_complete_step - 64)
        decided = self.service.decision(step)
        if decided is None:
            return None
        # the stop flag rides on the decision (every rank reads the same one): see PolicyService.request_stop
        return {**decided.to_json(), "stop": self.service.stopping(step), "plan": self._plans.get(step, [])}

    async def _in_turn(self, rank: int, step: int, group: int) -> bool:
        """Wait until ``rank``'s report of the step before ``step`` is in (at most
        :data:`REPORT_ORDER_WAIT_S`: a report lost on its way is then skipped, as it was before
        this wait); False if the group is replaced meanwhile."""
        deadline = time.monotonic() + REPORT_ORDER_WAIT_S
        while step > self._taken.get(rank, self._first_step - 1) + 1 and group == self._group:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("rank %d's report of step %d never came: taking its step %d", rank, step - 1, step)
                break
            took = self._took
            try:
                await asyncio.wait_for(took.wait(), timeout=left)
            except TimeoutError:
                continue
        return group == self._group

    def _advance(self) -> None:
        """Wake the reports waiting for their turn."""
        took, self._took = self._took, asyncio.Event()
        took.set()

    def _completed(self, decision: PersistDecision) -> None:
        if not self.service.quiet(decision.step) and (plan := self.service.plan()):
            self._plans[decision.step] = [d.to_json() for d in plan]  # (made once, as the step completes)
        handed = sum(self._layer_bytes[name] for name in decision.names)
        self.handed_bytes += handed
        if handed > self.peak_step_bytes:
            self.peak_step_bytes, self.peak_step = handed, decision.step
        self._clock.completed(decision.step, time.monotonic())
        self._apply_budget()

    def _apply_budget(self) -> None:
        if self._drain is not None:
            self.service.set_write_budget(self._drain.budget_for(self._clock.step_s))

    def writer_totals(self, writer: str, written_bytes: int, write_s: float) -> None:
        """A writer's running totals (it calls this after every write, without waiting)."""
        if self._drain is not None:
            self._drain.observe(writer, written_bytes=written_bytes, write_s=write_s)
            self._apply_budget()

    def forget_writers(self, writers: Sequence[str]) -> None:
        """These writers were replaced: their drain rate no longer counts."""
        if self._drain is not None:
            for writer in writers:
                self._drain.forget(writer)

    def schedule_view(self) -> dict[str, object]:
        """The peak bytes one step handed over (the schedule's decisions; the run's final save is
        not one), and the write budget with the drain bandwidth and step time behind it."""
        return {
            "peak_step_bytes": self.peak_step_bytes,
            "peak_step": self.peak_step,
            "handed_bytes": self.handed_bytes,
            "write_budget_bytes": self.service.write_budget_bytes,
            "drain_bytes_per_second": self._drain.bandwidth if self._drain is not None else None,
            "step_s": self._clock.step_s,
            "write_budget_enabled": self._drain is not None,
        }

    def _forget_before(self, step: int) -> None:
        for old in [s for s in self._ready if s < step]:
            del self._ready[old]
        for old in [s for s in self._plans if s < step]:
            del self._plans[old]

    def missing_reports(self, step: int) -> dict[int, int]:
        """The ranks whose report of ``step`` was not taken in, each with the last step it reported
        (0: none since the group started); empty once the step is complete. A rank waiting too long
        for a decision asks, to name the hung rank (``persistence.decision_timeout_s``)."""
        if step <= self.service.last_complete_step:
            return {}
        taken = {rank: self._taken.get(rank, self._first_step - 1) for rank in range(self.service.world_size)}
        return {rank: last for rank, last in taken.items() if last < step}

    @_RETRIED
    def last_complete_step(self) -> int | None:
        """The last step every rank reported; ``None`` on a rebuilt actor (it lost its count)."""
        return None if self.rebuilt else self.service.last_complete_step

    def settled(self, layer: str, version_step: int) -> None:
        """The supervisor: this version of ``layer`` committed or never will (see ``PersistGate``)."""
        self.service.settled(layer, version_step)

    def set_memory_period(self, period: int) -> None:
        """The supervisor chose the run's memory-version period (``"auto"``): the decisions carry it."""
        self.service.set_memory_period(period)

    @_RETRIED
    def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the same step (Ctrl-C on the driver, a staleness breach)."""
        self.service.request_stop(reason)

    @_RETRIED
    def restart(self, world_size: int, resume_after: int, persisted_steps: Mapping[str, int]) -> None:
        """A new worker group: release waiters of the lost attempt and rebase the policy (a
        rebuilt actor: its state from the versions the group resumes from, as after any loss)."""
        self.rebuilt = False
        for event in self._ready.values():
            event.set()
        self._ready.clear()
        self._group += 1
        self._taken.clear()
        self._first_step = resume_after + 1
        self._advance()
        self._plans.clear()
        self._clock.reset()
        self.service.restart(world_size=world_size, resume_after=resume_after, persisted_steps=persisted_steps)

    def metrics_view(self) -> dict[str, Any]:
        """What the metrics show of the policy (read-only): per layer the accumulated drift and
        the threshold at the latest step's learning rate, and the staleness budget."""
        lr = self.service.trace[-1].lr if self.service.trace else 0.0
        return {"lr": lr, **self.service.policy.metrics_view(lr), **self.schedule_view()}

    def trace(self) -> dict[str, object]:
        """The run's drift trace so far, in the simulator's JSON form less the layer sizes."""
        return {"steps": [observation_json(o) for o in self.service.trace]}
