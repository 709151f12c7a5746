"""What the driver reads of the Ray cluster it joined: its alive nodes, and whether the run's
storage suits them (the decision is :mod:`orchestrator.core.shared_storage`'s)."""

from __future__ import annotations

import ray

from orchestrator.core.shared_storage import shared_storage_problem
from orchestrator.store.errors import UnsafeStoreError


def alive_nodes() -> int:
    """Alive nodes of the connected Ray cluster."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def check_shared_storage(uri: str, *, shared: bool, opt_in: str = "cluster.shared_storage = true") -> None:
    """Refuse (:class:`UnsafeStoreError`) node-local storage on a multi-node cluster; Ray must be
    connected. See :mod:`orchestrator.core.shared_storage`."""
    problem = shared_storage_problem(uri, alive_nodes=alive_nodes(), shared_storage=shared, opt_in=opt_in)
    if problem:
        raise UnsafeStoreError(problem)
