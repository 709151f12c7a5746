"""The run's writer actors, per node: started on first use, drained with a deadline, and
replaced when they stop answering. Bookkeeping only; the supervisor decides when to drain."""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.runtime.persistence_pool import PersistenceWriter, WriterStats

logger = logging.getLogger(__name__)


class WriterPool:
    def __init__(self, *, store_uri: str, fsync: bool, per_node: int, supervisor: Any, policy: Any = None) -> None:
        self.store_uri = store_uri
        self.fsync = fsync
        self.per_node = per_node
        self.supervisor = supervisor
        self.policy = policy
        """The policy actor: writers report their totals to it (the write budget), and hears of replacements."""
        self._lock = threading.Lock()  # the dicts below; never held across a Ray call that waits
        self._by_node: dict[str, list[str]] = {}
        self._handles: dict[str, Any] = {}
        self._ids = itertools.count()

    def for_node(self, node_id: str) -> list[Any]:
        """The writer actors on ``node_id``, started on first use (or after being replaced)."""
        with self._lock:
            names = self._by_node.get(node_id) or []
            if not names:
                for _ in range(self.per_node):
                    name = f"writer-{next(self._ids)}@{node_id[:8]}"
                    self._handles[name] = PersistenceWriter.options(
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=True),
                    ).remote(self.store_uri, self.fsync, self.supervisor, name, self.policy)
                    names.append(name)
                self._by_node[node_id] = names
                logger.info("started %d writer(s) on node %s", self.per_node, node_id[:12])
            return [self._handles[n] for n in names]

    def _all(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._handles)

    def drain(self, deadline_s: float | None) -> tuple[str, ...]:
        """Wait up to ``deadline_s`` (``None``: for ever) until every writer has written and handed
        over what it holds; the names of those that did not answer (hung, or dead)."""
        writers = self._all()
        refs = {w.drain.remote(): name for name, w in writers.items()}
        if not refs:
            return ()
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=deadline_s)
        answered = set()
        for ref in ready:
            try:
                ray.get(ref)
                answered.add(refs[ref])
            except Exception as error:  # a dead writer answers with its death
                logger.error("writer %s failed its drain: %s", refs[ref], error)
        return tuple(sorted(set(writers) - answered))

    def replace(self, names: tuple[str, ...]) -> None:
        """Forget (and kill) these writers; their nodes get new ones on next use."""
        with self._lock:
            handles = [self._handles.pop(n) for n in names if n in self._handles]
            for node, members in self._by_node.items():
                self._by_node[node] = [m for m in members if m not in names]
        for handle in handles:
            try:
                ray.kill(handle)
            except Exception as error:  # already gone
                logger.info("killing a replaced writer: %s", error)
        if self.policy is not None:
            self.policy.forget_writers.remote(list(names))  # their rates no longer count in the budget
        logger.warning("replaced writer(s) %s", ", ".join(names))

    def replace_handle(self, handle: Any) -> bool:
        """Replace the writer behind ``handle`` (found dead by a rank); False if it was already
        replaced (another rank, or a recovery's drain, found it first)."""
        with self._lock:
            names = tuple(name for name, h in self._handles.items() if h == handle)
        if not names:
            return False
        self.replace(names)
        return True

    def stats(self, timeout_s: float | None = None) -> list[WriterStats]:
        """The live writers' statistics (a dead one, not yet replaced, is left out)."""
        refs = [w.get_stats.remote() for w in self._all().values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        stats = []
        for ref in ready:
            try:
                stats.append(ray.get(ref))
            except Exception as error:  # noqa: BLE001 - a dead writer; the next hand-over replaces it
                logger.debug("writer stats unavailable: %s", error)
        return stats
