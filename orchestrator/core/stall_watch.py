"""Whether a run has stopped making steps, seen from the driver's progress polls.

A rank that hangs (alive, not dead) stops its peers at the next collective they share with it, or
at the decision exchange: Ray sees every process alive, so nothing fails until the backend's
collective timeout (DeepSpeed's default: 30 minutes) or ``persistence.decision_timeout_s``. The
driver then says, once per stall, that no step has completed for so long, and which ranks had not
reported the next step (the policy actor's count): the hung rank where it stopped before its
report, every rank where the others wait for it inside a collective."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class StallWatch:
    """Feed it each poll's step; it answers how long the run has gone without one, once a stall
    passes ``after_s`` (once per stall: the next step ends it)."""

    after_s: float
    _step: int | None = field(default=None, init=False)
    _since: float = field(default=0.0, init=False)
    _told: bool = field(default=False, init=False)

    def stalled_for(self, step: int, *, training: bool, now: float) -> float | None:
        """``step``: the run's last completed step at ``now`` (monotonic seconds); ``training``:
        the group is training (not starting, recovering or finished: those have bounds of their
        own). The seconds since the last step, the first time they pass ``after_s``; else ``None``."""
        if step != self._step or not training:
            self._step, self._since, self._told = step, now, False
            return None
        waited = now - self._since
        if self._told or waited < self.after_s:
            return None
        self._told = True
        return waited


def stall_message(step: int, waited_s: float, missing: Mapping[int, int] | None, world_size: int) -> str:
    """What the driver says of a stall: since when, and who had not reported the next step
    (``missing``: rank → the last step it reported; ``None``: the policy actor did not say)."""
    head = f"no step completed for {waited_s:.0f}s (the last: step {step})"
    if missing is None:
        who = "the policy actor did not say which ranks reported the next step"
    elif not missing:
        who = f"every rank reported step {step + 1}: its decision or the storage holds the run"
    elif len(missing) == world_size:
        who = (
            f"no rank reported step {step + 1}: the ranks wait inside a collective, on a rank that hangs "
            "(the backend's timeout ends it) or on the data"
        )
    else:
        ranks = never_reported(missing)
        who = (
            f"{ranks} never reported step {step + 1}: hung, not dead (the ranks waiting on it fail at "
            "persistence.decision_timeout_s, or inside a collective at the backend's timeout)"
        )
    return f"{head}; {who}"


def never_reported(missing: Mapping[int, int]) -> str:
    """The ranks in ``missing`` (rank → the last step it reported, 0: none since its group
    started), as the driver's stall notice and a waiting rank's :class:`RankHung` name them."""
    return ", ".join(
        f"rank {rank} (last reported step {last})" if last else f"rank {rank} (none reported)"
        for rank, last in sorted(missing.items())
    )
