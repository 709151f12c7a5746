"""The run's writer actors, per node: started on first use, drained with a deadline, and
replaced when they stop answering. Bookkeeping only; the supervisor decides when to drain."""

from __future__ import annotations

import itertools
import logging
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from layercheck.orchestrator.core.persistence.writer_stats import WriterStats
from layercheck.orchestrator.runtime.handles import PolicyHandle, SupervisorHandle, WriterHandle, kill
from layercheck.orchestrator.runtime.writer_actor import WriterActor

logger = logging.getLogger(__name__)


class WriterPool:
    def __init__(
        self,
        *,
        store_uri: str,
        fsync: bool,
        per_node: int,
        supervisor: SupervisorHandle,
        policy: PolicyHandle | None = None,
        memory_bytes: int = 0,
        memory_mirror: bool = False,
        lease_valid_until: float | None = None,
    ) -> None:
        self.store_uri = store_uri
        self.fsync = fsync
        self.per_node = per_node
        self.supervisor = supervisor
        self.policy = policy
        """The policy actor: writers report their totals to it (the write budget), and hears of replacements."""
        self.memory_bytes = memory_bytes
        """Each writer's budget for shard files kept in memory (``persistence.memory_bytes``)."""
        self.memory_mirror = memory_mirror and memory_bytes > 0
        """Each writer sends its shards to a writer on another node (``persistence.memory_mirror``)."""
        self.lease_valid_until = lease_valid_until
        """Until when the run's lease is valid, as last renewed: each writer starts with it and hears
        of each renewal (``None``: no lease, nothing to check)."""
        self._lock = threading.Lock()  # the dicts below; never held across a Ray call that waits
        self._by_node: dict[str, list[str]] = {}
        self._handles: dict[str, WriterHandle] = {}
        self._ids = itertools.count()
        self._peer_generations = itertools.count()  # orders _assign_peers' plans (set_peer)

    def for_node(self, node_id: str) -> list[WriterHandle]:
        """The writer actors on ``node_id``, started on first use (or after being replaced)."""
        with self._lock:
            names = self._by_node.get(node_id) or []
            if not names:
                for _ in range(self.per_node):
                    name = f"writer-{next(self._ids)}@{node_id[:8]}"
                    # hard affinity: with soft=True Ray 2.60 put these 0-CPU actors on another node
                    # whenever the rank's node had no CPU free (always, under Ray Train): measured on a
                    # two-node local cluster, 3 of 3 landed elsewhere. The node asking is alive (its
                    # rank is), and a writer off it would cross the network and die with another node.
                    # (The ignore: an @ray.remote class, which mypy types as the class, python/mypy#3135.)
                    self._handles[name] = WriterActor.options(  # type: ignore[attr-defined]
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                    ).remote(
                        self.store_uri,
                        self.fsync,
                        self.supervisor,
                        name,
                        self.policy,
                        self.memory_bytes,
                        lease_valid_until=self.lease_valid_until,
                    )
                    names.append(name)
                self._by_node[node_id] = names
                logger.info("started %d writer(s) on node %s", self.per_node, node_id[:12])
                started = True
            else:
                started = False
            handles = [self._handles[n] for n in names]
        if started:
            self._assign_peers()
        return handles

    def _assign_peers(self) -> None:
        """Give each writer a peer on the next node (in node-id order) for its mirror copies; with one
        node, none. Called whenever the writers change, so a replaced peer is replaced here too."""
        if not self.memory_mirror:
            return
        with self._lock:
            nodes = sorted(n for n, names in self._by_node.items() if names)
            plan = {}
            for i, node in enumerate(nodes):
                peers = self._by_node[nodes[(i + 1) % len(nodes)]] if len(nodes) > 1 else []
                for j, name in enumerate(self._by_node[node]):
                    plan[name] = self._handles[peers[j % len(peers)]] if peers else None
            handles = {name: self._handles[name] for name in plan}
            generation = next(self._peer_generations)  # a plan made later supersedes, whatever the arrival order
        for name, peer in plan.items():
            handles[name].set_peer.remote(peer, generation)  # no wait: until it lands, a write is not mirrored

    def memory_index(self, node_id: str, timeout_s: float = 10.0) -> dict[str, list[tuple[str, WriterHandle]]]:
        """Which writers hold which shard files in memory, for a rank on ``node_id``: path →
        ``[(source, writer)]``, the node's own writers first (``memory_local``), then the others
        (``memory_remote``). A writer that does not answer within ``timeout_s`` is left out."""
        with self._lock:
            where = {name: node for node, names in self._by_node.items() for name in names}
            handles = dict(self._handles)
        refs = {handles[name].held.remote(): name for name in handles}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        index: dict[str, list[tuple[str, WriterHandle]]] = {}
        for ref in ready:
            name = refs[ref]
            try:
                held = ray.get(ref)
            except Exception as error:  # noqa: BLE001 - a dead writer holds nothing
                logger.info("writer %s cannot say what it holds: %s", name, error)
                continue
            source = "memory_local" if where.get(name) == node_id else "memory_remote"
            for path, _mirror in held:
                index.setdefault(path, []).append((source, handles[name]))
        for holders in index.values():
            holders.sort(key=lambda h: h[0] != "memory_local")
        return index

    def held_paths(self) -> set[str]:
        """The shard files the live writers hold in memory (the recovery plan's test of a memory
        version: ``supervision_ports.HeldPaths``)."""
        return set(self.memory_index(node_id=""))

    def _all(self) -> dict[str, WriterHandle]:
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

    def unfinished(self, names: tuple[str, ...], timeout_s: float = 10.0) -> list[tuple[str, int]]:
        """The versions ``(layer, step)`` the writers ``names`` (which did not answer a drain) still
        hold: queued, being written, or being committed. A writer that does not say within
        ``timeout_s`` (dead with its node) is left out, and logged."""
        handles = {name: h for name, h in self._all().items() if name in names}
        refs = {h.unfinished.remote(): name for name, h in handles.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        versions: list[tuple[str, int]] = []
        for ref in ready:
            try:
                versions += [(str(layer), int(step)) for layer, step in ray.get(ref)]
            except Exception as error:  # noqa: BLE001 - a dead writer's versions are not known
                logger.error("writer %s cannot say what it still holds: %s", refs[ref], error)
        for name in sorted(set(names) - {refs[ref] for ref in ready}):
            logger.error("writer %s did not say what it still holds within %gs", name, timeout_s)
        return versions

    def lease_renewed(self, valid_until: float) -> None:
        """The run's lease was renewed until ``valid_until``: every writer hears it (without waiting;
        a writer started from now on starts with it)."""
        with self._lock:
            self.lease_valid_until = valid_until
        for writer in self._all().values():
            writer.lease_renewed.remote(valid_until)

    def replace(self, names: tuple[str, ...]) -> None:
        """Forget (and kill) these writers; their nodes get new ones on next use."""
        with self._lock:
            handles = [self._handles.pop(n) for n in names if n in self._handles]
            for node, members in self._by_node.items():
                self._by_node[node] = [m for m in members if m not in names]
        for handle in handles:
            try:
                kill(handle)
            except Exception as error:  # already gone
                logger.info("killing a replaced writer: %s", error)
        self._assign_peers()  # writers that mirrored to a replaced one get a live peer
        if self.policy is not None:
            self.policy.forget_writers.remote(list(names))  # their rates no longer count in the budget
        logger.warning("replaced writer(s) %s", ", ".join(names))

    def replace_handle(self, handle: WriterHandle) -> bool:
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
