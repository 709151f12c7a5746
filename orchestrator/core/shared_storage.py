"""Is a run's storage reachable from every node of the cluster it runs on?

On a multi-node Ray cluster the writers and the recovering workers run on different nodes: a
plain path (``runs/{name}``, ``/data/runs/x``) is each node's own disk unless the user says it
is a filesystem every node mounts (NFS, Lustre, a FUSE bucket mount). Writers would then commit
to one disk and a worker restarted on another node would find nothing, so such a run is refused
before anything is written. Object stores (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``) are
shared by construction. Pure: the node count comes from the runtime.
"""

from __future__ import annotations

#: URI schemes of storage every node reaches; a plain path or ``file://`` is node-local unless opted in.
SHARED_SCHEMES: frozenset[str] = frozenset({"s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs"})


def storage_scheme(uri: str) -> str:
    """``s3`` for ``s3://bucket/x``; ``""`` for a plain path; ``file`` for ``file:///x``."""
    head, sep, _ = uri.partition("://")
    return head.lower() if sep else ""


def shared_storage_problem(
    uri: str, *, alive_nodes: int, shared_storage: bool, opt_in: str = "cluster.shared_storage = true"
) -> str:
    """Why ``uri`` cannot hold a run on a cluster of ``alive_nodes`` nodes ("" if it can); ``opt_in``
    names the setting that says a path is shared, as the user writes it."""
    if alive_nodes <= 1 or shared_storage or storage_scheme(uri) in SHARED_SCHEMES:
        return ""
    return (
        f"storage {uri} is a path on this node's disk, but the Ray cluster has {alive_nodes} nodes: writers "
        "and restarted workers on other nodes would not see it, and recovery would find nothing. Use object "
        'storage (storage = "s3://BUCKET/runs/{name}" or "gs://BUCKET/runs/{name}"), or a path on a '
        f"filesystem every node mounts and say so with {opt_in}"
    )
