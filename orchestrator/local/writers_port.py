"""Every rank's writer thread as the :class:`~layercheck.orchestrator.core.supervision_ports.WritersPort` of
rank 0's :class:`RunSupervisor`.

A drain is a round all ranks take part in: each rank drains its own writer with the deadline
and posts its answer through the :class:`Mailbox` (:meth:`LocalWriters.drain_mine`); rank 0's
port drains its own, waits for the others' answers, then for the receipt pump to have handled
(committed) every receipt posted. The writers that did not answer are named ``writer-rank{r}``;
a receipt pump still behind at the deadline is named ``receipts``. ``replace`` only records the
names: they travel with the group's answer and each rank replaces its own writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from layercheck.orchestrator.local.mailbox import Mailbox
from layercheck.orchestrator.local.writer import LocalWriter

logger = logging.getLogger(__name__)

#: The pump's name among the unanswered: its commits did not finish in time.
RECEIPTS = "receipts"
#: How long past the deadline rank 0 waits for a rank's answer: each rank answers right after
#: its own deadline, so a late answer is "not drained", not silence.
ANSWER_GRACE_S = 5.0


def writer_name(rank: int) -> str:
    return f"writer-rank{rank}"


def drain_mine(writer: LocalWriter, mailbox: Mailbox, *, round_: int, rank: int, deadline_s: float) -> bool:
    """A rank's part of drain ``round_``: drain its writer and say how it went."""
    ok = writer.drain(deadline_s)
    mailbox.say_drained(round_, rank, ok)
    return ok


class LocalWriters:
    """Rank 0's port. ``round`` is set by the coordinator before each collective drain."""

    def __init__(
        self, *, own: Callable[[], LocalWriter], mailbox: Mailbox, catch_up: Callable[[float], bool], world_size: int
    ) -> None:
        self.own = own
        """This rank's writer (a replaced one is a new object)."""
        self.mailbox = mailbox.client()
        self.catch_up = catch_up
        """The receipt pump's ``catch_up``: every receipt posted so far handled, by a deadline."""
        self.world_size = world_size
        self.round = 0
        self.replaced: list[str] = []
        """Writers named by ``replace`` since the round began."""
        self.drain_s = 0.0
        """How long the last drain took."""

    def begin(self, round_: int) -> None:
        self.round = round_
        self.replaced = []
        self.drain_s = 0.0

    def drain(self, deadline_s: float | None) -> tuple[str, ...]:
        deadline_s = 300.0 if deadline_s is None else deadline_s
        started = time.monotonic()
        answers = {0: drain_mine(self.own(), self.mailbox, round_=self.round, rank=0, deadline_s=deadline_s)}
        left = deadline_s - (time.monotonic() - started)
        answers.update(
            self.mailbox.await_drained(self.round, range(1, self.world_size), max(0.0, left) + ANSWER_GRACE_S)
        )
        unanswered = [writer_name(rank) for rank, ok in sorted(answers.items()) if not ok]
        left = deadline_s - (time.monotonic() - started)
        if not self.catch_up(max(0.001, left)):
            unanswered.append(RECEIPTS)
        self.drain_s = time.monotonic() - started
        if unanswered:
            logger.error("drain %d: %s did not finish within %gs", self.round, ", ".join(unanswered), deadline_s)
        return tuple(unanswered)

    def replace(self, names: tuple[str, ...]) -> None:
        logger.warning("replacing %s", ", ".join(names))
        self.replaced.extend(names)
