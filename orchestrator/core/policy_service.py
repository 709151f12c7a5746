"""The central policy view, without Ray: gathers every rank's drift report for a step, runs the
checkpoint policy once all ranks are in, and keeps the one decision every rank then follows.

The Ray actor (:mod:`layercheck.orchestrator.runtime.policy_actor`) is a thin asynchronous shell around this, so
the aggregation and bookkeeping are unit-tested with plain values.

**Quiet steps.** A policy that needs drift only every ``drift_every`` steps (``staggered``) decides
the steps in between, where nothing is measured, from its own state alone. So the service holds
the news that would change that state (settlements, the write budget) until the next measured
step, and every quiet step's decision is then known as soon as the measured step before it is
complete: :meth:`PolicyService.plan` gives them, and a rank holding the plan needs no answer from
the service on those steps (the per-step exchange is one message out, on measured steps one round
trip). The ranks still report every step, so ``last_complete_step`` (``t_fail``) stays exact.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from layercheck.orchestrator.core.persistence.persist_gate import PersistGate
from layercheck.policies.checkpoint_policy import CheckpointPolicy, KnowsQuietSteps
from layercheck.policies.configs import drift_measured
from layercheck.policies.decision import PersistDecision, StepObservation

logger = logging.getLogger(__name__)

#: Decisions kept for ranks that are behind; older ones are dropped.
DECISION_HISTORY = 64


@dataclass
class _Pending:
    lr: float
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    measured: bool = True
    """Every rank measured drift at this step (they measure on the same steps)."""


@dataclass
class _News:
    """What changes a policy's state from outside, held for the next measured step (quiet steps)."""

    settled: dict[str, int] = field(default_factory=dict)
    """Per layer, the newest version step that settled."""
    write_budget_bytes: int | None = None
    budget_changed: bool = False
    memory_period: int | None = None
    """The memory-version period to put on decisions from the next measured step on (``None``: no change)."""


class PolicyService:
    def __init__(
        self,
        policy: CheckpointPolicy,
        layers: Sequence[str],
        world_size: int,
        *,
        max_versions_in_flight: int = 1,
        drift_every: int = 1,
        memory_period: int | None = None,
    ) -> None:
        """``drift_every``: the policy config's (the ranks measure drift at step 1 and then every
        ``drift_every``-th step); above 1 the steps between are quiet (see the module).
        ``memory_period``: the memory versions' period every decision carries to the ranks
        (``persistence.memory_period = "auto"``: the run's choice, :meth:`set_memory_period`);
        ``None``: decisions carry none, each rank keeps the period it was given."""
        self.policy = policy
        self.drift_every = drift_every
        self._knows_quiet = drift_every > 1 and isinstance(policy, KnowsQuietSteps)  # (checked once: it is slow)
        self.layers = tuple(layers)
        self.world_size = world_size
        self.last_complete_step = 0
        self.trace: list[StepObservation] = []
        self._pending: dict[int, _Pending] = {}
        self._decisions: dict[int, PersistDecision] = {}
        self.stop_from: int | None = None
        """Decisions from this step on tell the ranks to stop (:meth:`request_stop`)."""
        self.stop_reason = ""
        self.gate = PersistGate(max_in_flight=max_versions_in_flight)
        """Holds back a layer whose previous version is still in flight (see :mod:`.persist_gate`)."""
        self.write_budget_bytes: int | None = None
        """The writers' drain budget (bytes per step) the next observations carry; ``None``: unknown."""
        self.memory_period = memory_period
        """The memory versions' period the decisions carry (``None``: none)."""
        self._news = _News()
        self._plan: list[PersistDecision] = []
        """The quiet steps' decisions after the last complete step, when it was measured."""
        self._plan_lr: float | None = None
        """Set while that plan is still to be made (on demand: a replica that decides every step
        itself never needs it), to the learning rate of the step it follows."""

    def quiet(self, step: int) -> bool:
        """Whether ``step``'s decision is known once the step before it is complete: no drift is
        measured there, and news waits for the next measured step."""
        return self.drift_every > 1 and not drift_measured(step, self.drift_every)

    def decides_nothing(self, step: int) -> bool:
        """Whether ``step``'s decision is known to be empty before the steps ahead of it complete:
        it and every step after the last complete one are quiet, and the policy says that nothing
        can be due before a later step (:class:`KnowsQuietSteps`). The gate passes such a decision
        as it is: its settlements wait for the measured step too."""
        done = self.last_complete_step
        if not self._knows_quiet or step <= done or step >= done + 1 + (-done) % self.drift_every:
            return False  # (the first measured step after ``done`` is the first ≡ 1 mod drift_every)
        return step < cast(KnowsQuietSteps, self.policy).decides_nothing_before(self.write_budget_bytes)

    def set_write_budget(self, budget_bytes: int | None) -> None:
        """The runtime's measured write budget (:mod:`layercheck.orchestrator.core.persistence.write_budget`), put on
        every step completed from now on (with quiet steps: from the next measured one)."""
        if self.drift_every > 1:
            self._news.write_budget_bytes, self._news.budget_changed = budget_bytes, True
        else:
            self.write_budget_bytes = budget_bytes

    def set_memory_period(self, period: int) -> None:
        """The run's memory-version period (``"auto"``: chosen from the first steps' timings), on
        every decision completed from now on (with quiet steps: from the next measured one, so a
        plan handed out never differs from the decisions it stands for)."""
        if self.drift_every > 1:
            self._news.memory_period = period
        elif period != self.memory_period:
            self.memory_period = period
            logger.info("decisions from step %d on carry memory_period %d", self.last_complete_step + 1, period)

    def _carrying(self, decision: PersistDecision) -> PersistDecision:
        """``decision`` with the memory period in force (as it is where none is)."""
        if self.memory_period is None:
            return decision
        return replace(decision, memory_period=self.memory_period)

    def plan(self) -> list[PersistDecision]:
        """The decisions of the quiet steps that follow the last complete step and have not
        completed, as made when the measured step before them completed (or at a restart); empty
        when the next step is measured. Every rank that holds them carries them out as they are:
        nothing can change them."""
        if self._plan_lr is not None:
            self._plan, self._plan_lr = self._plan_after(self.last_complete_step, self._plan_lr), None
        return list(self._plan)

    def report(
        self,
        *,
        step: int,
        rank: int,
        lr: float,
        abs_sums: Mapping[str, float],
        counts: Mapping[str, int],
        measured: bool = True,
    ) -> PersistDecision | None:
        """Add one rank's per-layer ``sum |Δθ|`` and element counts for ``step`` (``measured``
        false: the rank did not measure drift at this step, see ``drift_every``). Returns the
        step's decision once the last rank is in, else ``None``."""
        if step in self._decisions or step <= self.last_complete_step:
            return self._decisions.get(step)  # a late duplicate (a retried call)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        pending = self._pending.setdefault(step, _Pending(lr=lr))
        if rank in pending.ranks:
            return None
        pending.ranks.add(rank)
        pending.measured = pending.measured and measured
        for name, value in abs_sums.items():
            pending.sums[name] = pending.sums.get(name, 0.0) + float(value)
            pending.counts[name] = pending.counts.get(name, 0) + int(counts.get(name, 0))
        if len(pending.ranks) < self.world_size:
            return None
        return self._complete(step, self._pending.pop(step))

    def complete_quiet(self, step: int, lr: float) -> PersistDecision | None:
        """Complete quiet ``step`` (:meth:`quiet`) for every rank at once: a replica that decides
        every step itself (the local runtime) knows that each rank's report of it is empty. The
        same as every rank's :meth:`report` with no drift."""
        if not self.quiet(step):
            raise ValueError(f"step {step} is not quiet: its drift is measured and exchanged")
        if step in self._decisions or step <= self.last_complete_step:
            return self._decisions.get(step)
        self._pending.pop(step, None)
        return self._complete(step, _Pending(lr=lr, measured=False))

    def _complete(self, step: int, pending: _Pending) -> PersistDecision:
        if step != self.last_complete_step + 1:
            logger.warning("step %d completed after step %d: steps were skipped", step, self.last_complete_step)
        quiet = self.quiet(step)
        if not quiet:
            self._apply_news()
        measured = pending.measured and not quiet
        drift = (
            {
                name: pending.sums.get(name, 0.0) / pending.counts[name]
                for name in self.layers
                if pending.counts.get(name)
            }
            if measured
            else {}
        )
        observation = StepObservation(
            step=step, lr=pending.lr, drift=drift, write_budget_bytes=self.write_budget_bytes, measured=measured
        )
        self.trace.append(observation)
        decision = self._carrying(self.gate.admit(self.policy.observe(observation)))
        self._plan_lr = None  # too late to make one: this step's state is gone
        planned = self._plan.pop(0) if self._plan and self._plan[0].step == step else None
        if planned is not None and planned != decision:  # a policy whose quiet steps depend on more than its state
            logger.error("step %d: decided %s, but the ranks were given %s in advance", step, decision, planned)
        self.last_complete_step = step
        self._decisions[step] = decision
        # in step order (a restart keeps the older ones): drop from the front, not by a scan each step
        while (oldest := next(iter(self._decisions))) <= step - DECISION_HISTORY:
            del self._decisions[oldest]
        if not quiet:
            self._plan, self._plan_lr = [], pending.lr
        return decision

    def _plan_after(self, step: int, lr: float) -> list[PersistDecision]:
        """The decisions of the quiet steps after ``step``: empty where the policy knows they
        decide nothing (:meth:`decides_nothing`), else simulated on a copy of the policy and the gate."""
        quiet_steps = list(itertools.takewhile(self.quiet, range(step + 1, step + self.drift_every)))
        if not quiet_steps:
            return []
        if self.decides_nothing(quiet_steps[-1]):
            return [self._carrying(PersistDecision(step=quiet)) for quiet in quiet_steps]
        policy, gate = copy.deepcopy((self.policy, self.gate))
        planned = []
        for quiet in quiet_steps:
            seen = StepObservation(
                step=quiet, lr=lr, write_budget_bytes=self.write_budget_bytes, measured=False
            )  # (lr: not read on a step with no drift)
            planned.append(self._carrying(gate.admit(policy.observe(seen))))
        return planned

    def _apply_news(self) -> None:
        news, self._news = self._news, _News()
        for layer, version_step in news.settled.items():
            self.gate.settled(layer, version_step)
        if news.budget_changed:
            self.write_budget_bytes = news.write_budget_bytes
        if news.memory_period is not None and news.memory_period != self.memory_period:
            self.memory_period = news.memory_period
            logger.info(
                "decisions from step %d on carry memory_period %d", self.last_complete_step + 1, news.memory_period
            )

    def request_stop(self, reason: str) -> None:
        """Every rank stops after the step that follows the first decision not yet complete that
        the ranks collect (with quiet steps, the next measured step's: within ``drift_every``
        steps): the flag rides on decisions, so all ranks see it on the same one."""
        if self.stop_from is None:
            self.stop_from = self.last_complete_step + 1
            self.stop_reason = reason
            logger.warning(
                "the run stops: decisions from step %d on ask the ranks to stop (%s)", self.stop_from, reason
            )

    def stopping(self, step: int) -> bool:
        """Does the decision of ``step`` ask the ranks to stop?"""
        return self.stop_from is not None and step >= self.stop_from

    def decision(self, step: int) -> PersistDecision | None:
        return self._decisions.get(step)

    def settled(self, layer: str, version_step: int) -> None:
        """The version of ``layer`` at ``version_step`` committed or will never commit: the layer
        may be persisted again (with quiet steps: from the next measured step on)."""
        if self.drift_every > 1:
            self._news.settled[layer] = max(version_step, self._news.settled.get(layer, version_step))
        else:
            self.gate.settled(layer, version_step)

    def restart(self, *, world_size: int, resume_after: int, persisted_steps: Mapping[str, int]) -> None:
        """A new worker group resumes at ``resume_after + 1`` (``last_complete_step`` when a
        composite was loaded, 0 when training restarts from scratch): drop partial reports of
        the lost attempt and, for LayerCheck, count each layer's staleness and drift from the
        version the composite loaded (decisions not yet committed at the failure are lost)."""
        self.world_size = world_size
        self._pending.clear()
        self.last_complete_step = resume_after
        if self.stop_from is not None:
            self.stop_from = min(self.stop_from, resume_after + 1)  # a new group stops at once
        self.trace = [o for o in self.trace if o.step <= resume_after]
        self._decisions = {s: d for s, d in self._decisions.items() if s <= resume_after}
        self.policy.rebase(persisted_steps)
        self.gate.reset()
        if self._news.budget_changed:  # the newest budget; nothing of the lost group is in flight any more
            self.write_budget_bytes = self._news.write_budget_bytes
        if self._news.memory_period is not None:  # (the new group's decisions all carry it)
            self.memory_period = self._news.memory_period
        self._news = _News()
        self._plan, self._plan_lr = [], self.trace[-1].lr if self.trace else 0.0
        logger.info("policy restarted at step %d with %d ranks", self.last_complete_step + 1, world_size)
