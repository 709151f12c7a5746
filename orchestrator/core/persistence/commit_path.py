"""The commit path without Ray: shard receipts in, commits (and retries) out, every version
accounted for — committed, superseded, or lost with its reason; never silently dropped.

API (for a runtime shell)::

    commits = CommitPath(layers=..., config=SupervisionConfig())
    for action in commits.handle(ShardWritten(receipt=r)):      # a list of CommitVersion
        # after action.delay_s: record = store.commit(action.receipts)
        commits.handle(CommitSucceeded(record=record))          # -> []
        # or, if it raised: more = commits.handle(CommitFailed(action=action, error=str(e)))
    commits.handle(AbandonIncomplete(reason=..., lost=...))     # from RecoveryMachine, after a drain
    commits.handle(RunClosed(unfinished=((layer, step), ...), reason=...))  # the run's final drain ended
    commits.handle(HandedOver(layers=("embed",), step=40))      # rank 0's word: versions now owed
    commits.handle(ShardFailed(layer="embed", step=40))         # a rank's shard of it failed
    commits.unwritten.oldest(now=clock())                       # storage's oldest unanswered version

A whole version's commit is tried ``config.commit_tries`` times, the retries after
``commit_backoff_s``, doubling; then the version is counted lost and logged with the last error.
A retry is not made when a newer version of the layer committed meanwhile (the older one would
never be planned). Every version rank 0 handed over stays in :attr:`CommitPath.unwritten` until
it settles (:mod:`~layercheck.orchestrator.core.persistence.unwritten_versions`). Thread-safety is the
shell's: serialise calls to :meth:`CommitPath.handle`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from layercheck.orchestrator.core.persistence.commit_tracker import CommitTracker
from layercheck.orchestrator.core.persistence.unwritten_versions import UnwrittenVersions
from layercheck.orchestrator.core.recovery.config import SupervisionConfig
from layercheck.orchestrator.core.recovery.events import AbandonIncomplete
from layercheck.orchestrator.store.manifest import ShardReceipt, VersionRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ShardWritten:
    receipt: ShardReceipt


@dataclass(frozen=True, kw_only=True)
class CommitVersion:
    """Commit the version these receipts (one per rank) make, after waiting ``delay_s``; feed
    :class:`CommitSucceeded` or :class:`CommitFailed`. ``tries`` counts this one."""

    receipts: tuple[ShardReceipt, ...]
    tries: int = 1
    delay_s: float = 0.0
    partial: bool = False
    """Only some ranks' receipts: commit them as a partial version (``LayerStore.commit(partial=True)``)."""

    @property
    def label(self) -> str:
        first = self.receipts[0]
        ranks = f" (partial, {first.origin}: ranks {[r.rank for r in self.receipts]})" if self.partial else ""
        return f"{first.layer} step {first.step}{' (base)' if first.base else ''}{ranks}"


@dataclass(frozen=True, kw_only=True)
class CommitSucceeded:
    record: VersionRecord


@dataclass(frozen=True, kw_only=True)
class CommitFailed:
    action: CommitVersion
    error: str
    retry: bool = True
    """False: trying again cannot help (the store was taken over by another run)."""


@dataclass(frozen=True, kw_only=True)
class VersionsLost:
    """Shards of these versions ``(layer, step)`` were lost with a dead writer: they will never be
    whole. Each rank that used the writer reports its own; a version is counted once."""

    versions: tuple[tuple[str, int], ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class RunClosed:
    """The run's final drain is over: the versions ``(layer, step)`` in ``unfinished`` were still in
    the writers then (queued, being written or being committed). Each is counted lost, once, and
    from now on nothing is committed: a write that lands later was counted lost, never as written
    (and the driver is about to give up the store's lease)."""

    unfinished: tuple[tuple[str, int], ...]
    reason: str


@dataclass(frozen=True, kw_only=True)
class HandedOver:
    """Rank 0 handed ``layers`` over to its writer as versions of ``step`` (so did every rank)."""

    layers: tuple[str, ...]
    step: int


@dataclass(frozen=True, kw_only=True)
class ShardFailed:
    """A rank's shard of ``layer`` at ``step`` could not be written: that version will never be whole."""

    layer: str
    step: int


CommitEvent = (
    ShardWritten
    | CommitSucceeded
    | CommitFailed
    | AbandonIncomplete
    | VersionsLost
    | RunClosed
    | HandedOver
    | ShardFailed
)


@dataclass
class LayerStats:
    versions: int = 0
    bytes: int = 0
    last_step: int | None = None
    """The newest whole version's step (partial versions do not make a layer fresh)."""
    partial_versions: int = 0
    partial_bytes: int = 0


@dataclass(kw_only=True)
class CommitPath:
    layers: Collection[str]
    config: SupervisionConfig = field(default_factory=SupervisionConfig)
    tracker: CommitTracker = field(default_factory=CommitTracker)
    stats: dict[str, LayerStats] = field(init=False)
    commit_retries: int = 0
    """Commits tried again after a failure."""
    commit_failures: int = 0
    """Commit tries that storage failed (each retry's failure and the last one's, which loses the
    version): with the failed writes, the run's storage failures."""
    lost_versions: int = 0
    """Whole or partly written versions that will never be committed for want of storage or writers."""
    lost: list[str] = field(default_factory=list)
    """Why each lost version (or batch of versions) was lost, in order."""
    closed: str = ""
    """Why nothing more is committed (the run's final drain is over; :class:`RunClosed`); "" until then."""
    _lost_keys: set[tuple[str, int]] = field(default_factory=set)
    unwritten: UnwrittenVersions = field(default_factory=UnwrittenVersions)
    """The versions handed over and not settled yet: storage's backlog."""
    clock: Callable[[], float] = time.monotonic
    """When a version is handed over or committed (the supervisor's clock)."""

    def __post_init__(self) -> None:
        self.stats = {name: LayerStats() for name in self.layers}

    def handle(self, event: CommitEvent) -> list[CommitVersion]:
        if isinstance(event, ShardWritten):
            if self.closed:
                r = event.receipt
                logger.warning(
                    "%s step %d rank %d was written after the run ended: not committed", r.layer, r.step, r.rank
                )
                return []
            whole = self.tracker.add(event.receipt)
            return [CommitVersion(receipts=tuple(whole))] if whole is not None else []
        if isinstance(event, CommitSucceeded):
            self._committed(event.record)
            return []
        if isinstance(event, CommitFailed):
            return self._failed(event)
        if isinstance(event, AbandonIncomplete):
            return self._abandon(event)
        if isinstance(event, VersionsLost):
            self._count_lost(event.versions, event.reason)
            return []
        if isinstance(event, RunClosed):
            self._count_lost(event.unfinished, event.reason)
            self.closed = event.reason
            return []
        if isinstance(event, HandedOver):
            self.unwritten.handed_over(event.layers, step=event.step, at=self.clock(), newest=self.last_steps())
            return []
        if isinstance(event, ShardFailed):
            self.unwritten.settled(event.layer, event.step)
            return []
        raise TypeError(f"not a commit event: {event!r}")

    def _committed(self, record: VersionRecord) -> None:
        if self.closed and (record.layer, record.step) in self._lost_keys:
            logger.warning(
                "%s committed after the run's end counted it lost: the store holds it, the run's figures do not",
                record.version_id,
            )
            return
        stats = self.stats.setdefault(record.layer, LayerStats())
        self.unwritten.committed(record.layer, record.step, at=self.clock(), partial=record.partial)
        if record.partial:
            stats.partial_versions += 1
            stats.partial_bytes += record.nbytes
            return
        self.tracker.committed(record.layer, record.step)
        stats.versions += 1
        stats.bytes += record.nbytes
        stats.last_step = max(record.step, stats.last_step or 0)

    def _failed(self, event: CommitFailed) -> list[CommitVersion]:
        action, first = event.action, event.action.receipts[0]
        if event.retry:  # (not retried: the store is another run's now, which is no storage failure)
            self.commit_failures += 1
        newest = self.stats.get(first.layer, LayerStats()).last_step
        if newest is not None and newest >= first.step:
            self.tracker.abandoned += 1
            logger.warning(
                "commit of %s failed (%s); not retried: step %d of the layer is committed",
                action.label,
                event.error,
                newest,
            )
            return []
        if self.closed:
            if (first.layer, first.step) not in self._lost_keys:
                self._lose(1, f"commit of {action.label} failed as the run ended: {event.error}")
            return []
        if event.retry and action.tries < self.config.commit_tries:
            delay = self.config.backoff_s(action.tries)
            self.commit_retries += 1
            retry = CommitVersion(
                receipts=action.receipts, tries=action.tries + 1, delay_s=delay, partial=action.partial
            )
            logger.warning(
                "commit of %s failed (try %d of %d: %s); retrying in %.2fs (config commit_tries)",
                action.label,
                action.tries,
                self.config.commit_tries,
                event.error,
                delay,
            )
            return [retry]
        reason = f"commit of {action.label} failed {action.tries} time(s), last: {event.error}"
        self._lose(1, reason)
        if not action.partial:
            self.unwritten.settled(first.layer, first.step)
        return []

    def _abandon(self, event: AbandonIncomplete) -> list[CommitVersion]:
        before = self.tracker.abandoned
        self.unwritten.clear()
        kept = self.tracker.take_incomplete(upto=event.keep_upto)
        count = self.tracker.abandoned - before
        if count and event.lost:  # never whole; what survivors wrote of them is kept below
            self._lose(count, f"{count} incomplete version(s): {event.reason}")
        elif count:
            logger.info("abandoned %d incomplete version(s): %s", count, event.reason)
        if kept:
            logger.info(
                "committing %d version(s) the surviving ranks wrote as partial versions (%s)", len(kept), event.reason
            )
        return [CommitVersion(receipts=tuple(receipts), partial=True) for receipts in kept]

    def _count_lost(self, versions: Collection[tuple[str, int]], reason: str) -> None:
        """Each of ``versions`` will never be whole: counted lost once, whoever reports it."""
        fresh = list(dict.fromkeys(v for v in versions if v not in self._lost_keys))
        for layer, step in fresh:
            self._lost_keys.add((layer, step))
            self.tracker.forget(layer, step)
            self.unwritten.settled(layer, step)
        if fresh:
            shown = ", ".join(f"{layer}@{step}" for layer, step in fresh[:8]) + (" …" if len(fresh) > 8 else "")
            self._lose(len(fresh), f"{len(fresh)} version(s) ({shown}): {reason}")

    def _lose(self, count: int, reason: str) -> None:
        self.lost_versions += count
        self.lost.append(reason)
        logger.error("lost %d version(s): %s", count, reason)

    def last_steps(self) -> dict[str, int | None]:
        return {name: s.last_step for name, s in self.stats.items()}

    def rebased(self, persisted_steps: Mapping[str, int]) -> None:
        """A group resumes from a composite whose layers were persisted at ``persisted_steps``: a
        layer's staleness counts from there, not from step 0, when this run has not committed a
        newer version of it (a ``--resume`` has committed none: its store's versions are older
        runs' work)."""
        for layer, step in persisted_steps.items():
            stats = self.stats.setdefault(layer, LayerStats())
            if stats.last_step is None or stats.last_step < step:
                stats.last_step = step
