"""What a rank's ``SupervisorActor.join`` answers: a reference to its group's
:class:`~layercheck.orchestrator.core.recovery.events.ResumeInfo`, which the supervisor puts in the
object store once per group. The composite's records name every rank's file of every layer, so
answering each rank with a copy of its own pickled N copies of N ranks' files in the supervisor (at
64 ranks, 42% of its CPU during a recovery; ``bench/scale``); a reference is fetched once per node."""

from __future__ import annotations

import ray

from layercheck.orchestrator.core.recovery.events import ResumeInfo


def resume_of(answer: ResumeInfo | ray.ObjectRef[ResumeInfo]) -> ResumeInfo:
    """The :class:`ResumeInfo` behind a ``join``'s answer (a reference; a value passes as it is)."""
    return ray.get(answer) if isinstance(answer, ray.ObjectRef) else answer
