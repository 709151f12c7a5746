"""The driver and the Ray cluster: joining one (or starting a local Ray), and what the driver
reads of it: its alive nodes, and whether the run's storage suits them (the decision is
:mod:`layercheck.orchestrator.core.shared_storage`'s)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Mapping

import ray

from layercheck.orchestrator.core.run_config import RunConfig
from layercheck.orchestrator.core.shared_storage import shared_storage_problem
from layercheck.orchestrator.runtime import ray_noise
from layercheck.orchestrator.runtime.names import NAMESPACE
from layercheck.orchestrator.store.errors import UnsafeStoreError
from layercheck.workers.engines import WORKER_ENV
from layercheck.workers.faults import FAULTS_ENV

logger = logging.getLogger(__name__)


def alive_nodes() -> int:
    """Alive nodes of the connected Ray cluster."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def node_resources() -> list[dict[str, float]]:
    """Each alive node's total resources (``{"CPU": 16.0, "GPU": 8.0, ...}``)."""
    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def check_shared_storage(uri: str, *, shared: bool, opt_in: str = "cluster.shared_storage = true") -> None:
    """Refuse (:class:`UnsafeStoreError`) node-local storage on a multi-node cluster; Ray must be
    connected. See :mod:`layercheck.orchestrator.core.shared_storage`."""
    problem = shared_storage_problem(uri, alive_nodes=alive_nodes(), shared_storage=shared, opt_in=opt_in)
    if problem:
        raise UnsafeStoreError(problem)


PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"


def worker_env(*, use_gpu: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment every Ray process of the run starts with (the job's ``runtime_env``)."""
    env = {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        # Ray Train's print patch routes a worker's print() through its logger; around a TRL run it
        # dumped dill's bytecode disassembly (3,635 console lines against 181 without). Off unless
        # the user asks for it.
        PRINT_PATCH_ENV: environ.get(PRINT_PATCH_ENV, "0"),
    }
    if not use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    for name in WORKER_ENV:  # e.g. the workers check the DeepSpeed version, not the driver
        if name in environ:
            env[name] = environ[name]
    # a test's fault injector (workers/faults.py): a local Ray's processes inherit the driver's
    # environment anyway, a cluster joined sees only what the job's runtime_env carries
    if FAULTS_ENV in environ:
        env[FAULTS_ENV] = environ[FAULTS_ENV]
    return env


def connect(config: RunConfig) -> None:
    """Join ``cluster.address``, ``RAY_ADDRESS`` or the job's cluster; else start a local Ray."""
    cluster = config.cluster
    connect_to(
        address=cluster.address,
        use_gpu=cluster.use_gpu,
        cpus=int(cluster.ray_workers * cluster.cpus_per_worker) + 1,
        dashboard=cluster.ray_dashboard,
    )


#: Ray Train's preemption watcher (an actor per worker group) waits for the autoscaler to drain a
#: node; a local Ray has no autoscaler, so the one LayerCheck starts runs without it.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

_LOCAL_RAY = {"without_dashboard": False}


def has_state_api() -> bool:
    """Whether Ray's State API answers on the connected cluster: it is served by Ray's dashboard,
    which the local Ray LayerCheck starts runs without (``cluster.ray_dashboard``); a cluster
    joined is taken to have one."""
    return not _LOCAL_RAY["without_dashboard"]


def connect_to(*, address: str = "", use_gpu: bool = False, cpus: int = 1, dashboard: bool = False) -> None:
    """Join ``address``, ``RAY_ADDRESS`` or the job's cluster; else start a local Ray with at
    least ``cpus`` CPUs, with Ray's dashboard if ``dashboard``. Workers get ``DS_ACCELERATOR=cpu``
    without GPUs. No-op if Ray is up."""
    if ray.is_initialized():
        return
    _LOCAL_RAY["without_dashboard"] = False
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")  # read by the controller
    env_vars = worker_env(use_gpu=use_gpu, environ=os.environ)
    joined = address or os.environ.get("RAY_ADDRESS", "") or _local_cluster()
    if joined:
        ray.init(address=joined, namespace=NAMESPACE, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        ray_noise.install()
        logger.info("joined the Ray cluster at %s", joined)
        return
    cpus = max(os.cpu_count() or 1, cpus)
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")  # read by the controller (Ray Train propagates it)
    # address="local": a new local Ray even if Ray's address file names a cluster (a stale one).
    # Its processes inherit the workers' environment from this one's, instead of a job runtime_env:
    # with one, every actor and worker started cold (~1.1 s each on 2 cores, against ~0.5 s from
    # the pool Ray starts ahead)
    with _environ(env_vars):
        ray.init(address="local", num_cpus=cpus, include_dashboard=dashboard, namespace=NAMESPACE, log_to_driver=True)
    _LOCAL_RAY["without_dashboard"] = not dashboard
    ray_noise.install()
    logger.info("started a local Ray with %d CPUs", cpus)


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the ``with`` body, and what was there before after it."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _local_cluster() -> str | None:
    """The cluster a ``ray start`` runs on this machine (which ``ray.init()`` would join, and where
    ``num_cpus`` is an error), else None. Private Ray API, hence the guard."""
    try:
        from ray._private.services import find_bootstrap_address

        address = find_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - a moved private API must not stop a run: start a local Ray
        return None
    if address and not _answers(address):
        # a `ray start` that crashed or was killed leaves its address file behind; joining it
        # would retry for minutes and fail
        logger.warning(
            "Ray's address file names %s, which does not answer (a stopped cluster): starting a local Ray", address
        )
        return None
    return address


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` (a live GCS does)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
