"""The capture window: how long a broken worker group's survivors are given to hand over their
state (:mod:`layercheck.workers.capture`) before Ray Train tears the group down, and what they handed over.

Ray Train tears a group down about 0.06 s after a worker dies (health checks every 0.2 s), while
a gloo survivor learns of the death only when its next collective raises, ~0.05-0.08 s after it:
without help it would be killed mid-capture. So LayerCheck widens the window by design: Ray
Train's controller calls a LayerCheck callback before it shuts a failed group down
(``layercheck.orchestrator.runtime.capture_hold``), which waits here — bounded — until every survivor has
finished or given up:

* a survivor says :meth:`began` when its step raised, and :meth:`ended` once its writer holds the
  capture (or it gave up);
* :meth:`await_survivors` waits up to ``grace_s`` for each named survivor to begin (a survivor
  blocked in an NCCL collective never does) and up to ``timeout_s`` for those that began to end.

Ray-free and thread-safe: the supervisor actor hosts one, and its calls arrive on many threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CaptureReport:
    """One survivor's hand-over, as it reports it."""

    rank: int
    attempt: int
    step: int
    """The step the captured state is at."""
    layers: int = 0
    nbytes: int = 0
    held: bool = False
    """The writer holds every layer's capture (else: what is missing was lost)."""
    seconds: float = 0.0
    """From the error to the writer holding the capture."""
    raised_at: float = 0.0
    """Unix time the survivor's step raised."""
    error: str = ""
    """Why the capture was incomplete, if it was."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class HoldOutcome:
    """What one teardown hold saw: the controller's view of a capture window."""

    attempt: int
    survivors: tuple[int, ...]
    captured: tuple[int, ...]
    """Survivors whose capture the writers hold."""
    missed: tuple[int, ...]
    """Survivors that never began (blocked in a collective, already gone) or did not finish in time."""
    teardown_at: float
    """Unix time the controller began the teardown (entered the hold)."""
    hold_s: float
    """How long the teardown was held back."""
    released: dict[str, str] = field(default_factory=dict)
    """Per survivor (rank as a string), its answer to the controller's request to abort a collective
    blocked on the lost ranks (``layercheck.workers.collective_abort.AbortDecision`` values: ``abort`` on NCCL)."""

    def to_json(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass
class CaptureWindow:
    grace_s: float = 2.0
    timeout_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    reports: list[CaptureReport] = field(default_factory=list)
    holds: list[HoldOutcome] = field(default_factory=list)
    _began: dict[tuple[int, int], float] = field(default_factory=dict)
    _ended: dict[tuple[int, int], CaptureReport] = field(default_factory=dict)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def began(self, rank: int, attempt: int) -> None:
        with self._changed:
            self._began.setdefault((attempt, rank), self.clock())
            self._changed.notify_all()

    def ended(self, report: CaptureReport) -> None:
        with self._changed:
            self._began.setdefault((report.attempt, report.rank), self.clock())
            self._ended[(report.attempt, report.rank)] = report
            self.reports.append(report)
            self._changed.notify_all()
        logger.info(
            "rank %d (attempt %d) captured %d layers at step %d: %d bytes in %.3fs%s",
            report.rank,
            report.attempt,
            report.layers,
            report.step,
            report.nbytes,
            report.seconds,
            "" if report.held else f" (incomplete: {report.error})",
        )

    def await_survivors(
        self,
        attempt: int,
        survivors: Collection[int],
        *,
        teardown_at: float,
        failed: Collection[int] = (),
        released: Mapping[int, str] | None = None,
    ) -> HoldOutcome:
        """Block until each of ``survivors`` (ranks of ``attempt``) has ended its capture, or did
        not begin within ``grace_s``, or ``timeout_s`` passed since the wait began. ``failed``: ranks
        Ray Train saw fail; one that began a capture (it raised after handing it over) is waited for
        too, one that did not is dead and not waited for."""
        started = self.clock()
        keys = [(attempt, rank) for rank in sorted(set(survivors) | set(failed))]
        dead = {(attempt, rank) for rank in failed}

        def settled() -> bool:
            now = self.clock()
            if now - started >= self.timeout_s:
                return True
            return all(
                key in self._ended or (key not in self._began and (key in dead or now - started >= self.grace_s))
                for key in keys
            )

        with self._changed:
            while not settled():
                self._changed.wait(timeout=0.05)
            captured = tuple(r for a, r in keys if (a, r) in self._ended and self._ended[(a, r)].held)
            alive = tuple(r for key in keys if key not in dead or key in self._began for r in (key[1],))
            outcome = HoldOutcome(
                attempt=attempt,
                survivors=alive,
                captured=captured,
                missed=tuple(r for r in alive if r not in captured),
                teardown_at=teardown_at,
                hold_s=self.clock() - started,
                released={str(rank): answer for rank, answer in (released or {}).items()},
            )
            self.holds.append(outcome)
        if outcome.missed:
            logger.warning(
                "teardown of attempt %d held %.2fs: ranks %s captured, %s did not (their slices come from "
                "stored versions)",
                attempt,
                outcome.hold_s,
                list(captured),
                list(outcome.missed),
            )
        else:
            logger.info("teardown of attempt %d held %.2fs for ranks %s' captures", attempt, outcome.hold_s, captured)
        return outcome

    def held_step(self, attempt: int) -> int | None:
        """The newest step a survivor of ``attempt`` holds a whole capture of (``None``: none)."""
        with self._changed:
            steps = [r.step for (a, _), r in self._ended.items() if a == attempt and r.held]
        return max(steps, default=None)

    def status(self) -> dict[str, Any]:
        """For the run's status and summary: every capture and every hold, in order."""
        with self._changed:
            return {"captures": [r.to_json() for r in self.reports], "holds": [h.to_json() for h in self.holds]}


def capture_figures(capture: dict[str, Any]) -> list[dict[str, Any]]:
    """Per broken group, the survivors' captures and the teardown hold: how long survivors had
    (from their step raising to Ray Train's teardown: what they would have had without the hold)
    and how fast a capture was handed over."""
    out = []
    for hold in capture.get("holds", []):
        mine = [c for c in capture.get("captures", []) if c["attempt"] == hold["attempt"]]
        raised = [c["raised_at"] for c in mine if c.get("raised_at")]
        seconds = sum(c["seconds"] for c in mine)
        nbytes = sum(c["nbytes"] for c in mine)
        out.append(
            {
                "attempt": hold["attempt"],
                "survivors": hold["survivors"],
                "captured": hold["captured"],
                "missed": hold["missed"],
                "steps": sorted({c["step"] for c in mine}),
                "bytes": nbytes,
                "capture_s": max((c["seconds"] for c in mine), default=0.0),
                "capture_gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else None,
                "window_s": hold["teardown_at"] - min(raised) if raised else None,
                "hold_s": hold["hold_s"],
            }
        )
    return out


def recovery_step(last_complete: int, captured_step: int | None) -> int:
    """The step a lost group is recovered at: the last step every rank reported or, when a
    survivor's captured state is one step past it, that step. A survivor stands there when it
    finished its optimizer step ``t + 1`` (its gradients reduced with every rank's, the dead ones'
    included) before the group broke, while a dead rank's report of ``t + 1`` was lost with it.
    Recovering at ``t + 1`` uses that exact state; the dead ranks' slices miss ``t + 1``'s update
    as any stale slice misses updates. Recovering at ``t`` would have to drop the capture (resuming
    at ``t + 1`` would apply its update twice)."""
    if captured_step is not None and captured_step == last_complete + 1:
        logger.warning(
            "a survivor's state is at step %d, one past the last step every rank reported (%d): recovering there",
            captured_step,
            last_complete,
        )
        return captured_step
    return last_complete
