"""The configuration of one LayerCheck training run, read from TOML or YAML.

One table per component; every field is documented on its dataclass and validated when the
file is loaded, so a typo or a bad value fails on the driver with the field's dotted name
(``policy.k0: must be > 0``) before any worker starts. ``examples/`` has annotated files.
A component's table lives beside the component where it has a package of its own (``[persistence]``:
:mod:`layercheck.orchestrator.core.persistence.config`, ``[policy]``, ``[model]``, ``[data]`` …);
the run's own sections are here. The checks against the data and the model a config names are in
:mod:`layercheck.orchestrator.core.run_checks`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from layercheck.orchestrator.core.persistence.config import PersistenceConfig
from layercheck.policies.config_loader import ConfigError, from_mapping, require, to_mapping
from layercheck.policies.configs import (
    DEFAULT_POLICY,
    POLICY_CONFIGS,
    PolicyConfig,
    policy_config,
    policy_name,
    schedule_warnings,
)
from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.data.config import DataConfig
from layercheck.workers.faults import FAULTS_ENV

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Set by Ray 2.60 in the environment of a ``ray job submit`` entrypoint (the job's config JSON).
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
#: Ray unpacks a job's ``--working-dir`` here (under its session directory) and deletes it later.
RAY_WORKING_DIR_CACHE = os.path.join("runtime_resources", "working_dir_files")

_RUN_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the workers run."""

    num_workers: int = 2
    """Training processes (one DeepSpeed rank each)."""
    min_workers: int = 0
    """0: a fixed group of ``num_workers``. Else Ray Train's elastic group: training starts (and,
    after a node is lost, resumes) with as few as ``min_workers``; the composite is re-sliced."""
    resize_check_s: float = 60.0
    """Elastic group (``min_workers`` > 0): how often Ray Train looks for room to grow the group back
    (a returned or new node); growing restarts the group, which resumes like a recovery."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); otherwise CPU with gloo."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker."""
    max_failures: int = 3
    """Worker-group restarts Ray Train may make before the run fails."""
    address: str = ""
    """Ray cluster to join; empty: ``RAY_ADDRESS`` or the job's cluster, else a new local one."""
    ray_dashboard: bool = False
    """The local Ray LayerCheck starts (no cluster to join) runs Ray's dashboard (its web UI on
    127.0.0.1:8265). Off by default: it is ten processes that cost the start about 7 CPU-seconds;
    LayerCheck's metrics reach Prometheus and Grafana without it. A cluster you join keeps its own."""
    in_place: bool = False
    """Recover from a lost worker in place: Ray Train replaces only that worker, the survivors keep
    their processes (no restart, no imports) and rebuild their engines there; every rank resumes
    at ``t_fail + 1`` as after a full restart, which is the fallback if anything on this path
    fails. Not with an elastic group (``min_workers``)."""
    spares: int = 0
    """``in_place``: warm spares, workers beyond ``num_workers`` that do their imports, build their
    model and wait (each holds a worker's resources, idle). A lost rank's place is taken by a
    spare at once, while Ray Train starts the replacement, which becomes the next spare."""
    regroup_timeout_s: float = 600.0
    """``in_place``: how long the ranks wait for each other (a replacement's start included) to
    form the process group again; past it they raise (a failed recovery in place: every rank is
    then replaced, as under a full restart)."""
    shared_storage: bool = False
    """``storage`` is a path on a filesystem every node mounts (NFS, Lustre, a bucket mount). On a
    cluster of more than one node a plain path is refused without it: each node would write to
    its own disk. Object storage (``s3://``, ``gs://``) needs no opt-in."""

    def __post_init__(self) -> None:
        require(self.num_workers >= 1, "num_workers", ">= 1", self.num_workers)
        require(
            0 <= self.min_workers <= self.num_workers,
            "min_workers",
            f"in 0..num_workers ({self.num_workers})",
            self.min_workers,
        )
        require(self.cpus_per_worker > 0, "cpus_per_worker", "> 0", self.cpus_per_worker)
        require(self.resize_check_s > 0, "resize_check_s", "> 0", self.resize_check_s)
        require(self.max_failures >= 0, "max_failures", ">= 0", self.max_failures)
        require(self.regroup_timeout_s > 0, "regroup_timeout_s", "> 0", self.regroup_timeout_s)
        require(
            not (self.in_place and self.min_workers),
            "in_place",
            "false with an elastic group (min_workers > 0): Ray Train replaces workers in place only in a fixed group",
            self.in_place,
        )
        require(self.spares >= 0, "spares", ">= 0", self.spares)
        require(
            not self.spares or self.in_place,
            "spares",
            "0 unless in_place = true (a spare takes a lost rank's place in the survivors' group)",
            self.spares,
        )

    @property
    def ray_workers(self) -> int:
        """The workers Ray Train runs: the training ranks and the spares."""
        return self.num_workers + self.spares


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """The recovery rehearsal (the demo's): SIGKILL one worker once, mid-run, and watch the run
    recover. Carried out through :mod:`layercheck.workers.faults`, where the tests inject theirs."""

    kill_at_step: int = 0
    """After this step completes, the worker of ``kill_rank`` kills itself, once (0: never). The
    only injected failure a run config holds: the tests inject theirs (killed writers, stalled
    writes, errors, failed recoveries) through ``LAYERCHECK_FAULTS`` (``layercheck.workers.faults``)."""
    kill_rank: int = 0
    """The rank that is killed (a rank outside the group: none is, with a warning)."""

    def __post_init__(self) -> None:
        require(self.kill_at_step >= 0, "kill_at_step", ">= 0", self.kill_at_step)
        require(self.kill_rank >= 0, "kill_rank", ">= 0", self.kill_rank)


#: ``[fault]`` keys that are gone, with the values they had by default. They were test-only: the
#: tests inject those failures through ``LAYERCHECK_FAULTS`` (:mod:`layercheck.workers.faults`).
REMOVED_FAULT_KEYS: dict[str, Any] = {
    "kill_all_ranks": False,
    "raise_at_step": 0,
    "kill_writer_at_step": 0,
    "fail_in_place_recovery": False,
    "kill_again_in_recovery": False,
    "stall_writes_s": 0.0,
    "stall_writes_node": "",
    "stall_writes_after_step": 0,
}


def _without_removed_fault_keys(data: Mapping[str, Any], *, stored: bool) -> Mapping[str, Any]:
    """``data`` without the removed ``[fault]`` keys; one is refused by name, unless ``stored`` and
    at its old default (a ``run.json`` a store kept from before they went holds every key so)."""
    fault = data.get("fault")
    if not isinstance(fault, Mapping):
        return data
    for key, value in fault.items():
        if key in REMOVED_FAULT_KEYS and not (stored and value == REMOVED_FAULT_KEYS[key]):
            raise ConfigError(
                f"fault.{key}: gone; it was test-only (tests inject such failures through {FAULTS_ENV}, "
                "layercheck.workers.faults); [fault] keeps kill_at_step and kill_rank"
            )
    return {**data, "fault": {k: v for k, v in fault.items() if k not in REMOVED_FAULT_KEYS}}


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint of the run."""

    port: int = 9464
    """0 disables the exporter."""
    host: str = "auto"
    """Bind address. ``auto``: 127.0.0.1 on a one-node Ray cluster, the IP of the supervisor's
    node on a multi-node one (so a Prometheus on another node reaches it); ``node``: that IP
    always; or an address (``0.0.0.0``: every interface)."""
    discovery_dir: str = "/tmp/layercheck-metrics/prometheus"
    """The driver writes ``<run id>.json`` here, a Prometheus ``file_sd`` file naming the
    endpoint, while the run is live (``dashboards/prometheus.yml`` watches it); empty: none."""

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", "in 0..65535", self.port)
        require(bool(self.host.strip()), "host", "auto, node or an address", self.host)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "layercheck"
    """The run's name: the Ray Train run and the actors are named after it."""
    steps: int = 100
    """Optimizer steps to train."""
    storage: str = "runs/{name}"
    """Store URI (a path, ``file://``, ``s3://``, ``gs://``); ``{name}`` is replaced by the run name."""
    log_every: int = 10
    """Print progress every this many steps."""
    model: ModelConfig
    """The model: ``[model.hf_config]`` (a transformers config, random init) or ``model.path``."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training text and its order."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """How DeepSpeed runs the model."""
    policy: PolicyConfig = field(default_factory=lambda: policy_config(DEFAULT_POLICY))
    """The checkpoint policy: ``name`` = ``staggered`` (default: staggered, byte-budgeted,
    drift-aware periodic saves), ``layercheck`` (the paper's thresholds), ``drift-optimal``,
    ``interval`` or ``never``, and its parameters."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Workers and failure handling."""
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    """The asynchronous writers."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Failure injection."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The Prometheus endpoint."""

    def __post_init__(self) -> None:
        require(bool(_RUN_NAME.match(self.name)), "name", "letters, digits, '_', '.', '-'", self.name)
        require(self.steps >= 1, "steps", ">= 1", self.steps)
        require(self.log_every >= 1, "log_every", ">= 1", self.log_every)
        require(
            bool(self.storage.strip()),
            "storage",
            "a path or URI of the run's own directory (empty means the working directory)",
            self.storage,
        )

    @property
    def storage_uri(self) -> str:
        return self.storage.replace("{name}", self.name)

    def with_absolute_storage(self) -> RunConfig:
        """The same config with a relative storage path (and relative data and tokenizer paths)
        made absolute against this process's working directory: Ray Train workers and actors run
        in directories of their own."""
        config = dataclasses.replace(self, data=self.data.with_absolute_paths())
        if config.model.path is not None and not os.path.isabs(config.model.path):
            config = dataclasses.replace(
                config, model=dataclasses.replace(config.model, path=os.path.abspath(config.model.path))
            )
        uri = config.storage_uri
        if "://" in uri or os.path.isabs(uri):
            return config
        check_relative_storage(uri)
        return dataclasses.replace(config, storage=os.path.abspath(uri))

    @property
    def policy_name(self) -> str:
        return policy_name(self.policy)

    def to_json(self) -> dict[str, Any]:
        data = to_mapping(self)
        data["policy"] = {"name": self.policy_name, **data["policy"]}
        return data


def config_warnings(config: RunConfig) -> list[str]:
    """Settings that are legal but probably not meant, for the driver to show before it starts."""
    warnings = []
    if config.steps > config.optim.total_steps:
        warnings.append(
            f"steps = {config.steps} but optim.total_steps = {config.optim.total_steps}: the learning-rate "
            f"schedule ends at step {config.optim.total_steps} and steps {config.optim.total_steps + 1}-"
            f"{config.steps} train at its final rate (lr x min_lr_ratio = {config.optim.lr * config.optim.min_lr_ratio:g}); "
            f"set optim.total_steps = {config.steps} to stretch the schedule"
        )
    warnings += schedule_warnings(config.policy, config.steps)
    fault = config.fault
    if fault.kill_at_step and fault.kill_rank >= config.cluster.num_workers:
        # not an error: `--resume --set cluster.num_workers=1` of a demo run must work as written
        warnings.append(
            f"fault.kill_rank = {fault.kill_rank} is not a rank of the {config.cluster.num_workers}-"
            f"worker group: no failure is injected at step {fault.kill_at_step}"
        )
    return warnings


def parse_run_config(data: Mapping[str, Any]) -> RunConfig:
    """A validated :class:`RunConfig` from parsed TOML/YAML/JSON (a stored ``run.json`` too: a
    removed ``[fault]`` key is dropped at its old default, refused otherwise)."""
    data = dict(_without_removed_fault_keys(data, stored=True))
    policy = data.pop("policy", {"name": DEFAULT_POLICY})
    if not isinstance(policy, Mapping) or "name" not in policy:
        raise ConfigError(f"policy: must be a table with a 'name' ({', '.join(POLICY_CONFIGS)})")
    if "model" not in data:
        raise ConfigError("model: missing; give model.hf_config (a transformers config) or model.path")
    params = {k: v for k, v in policy.items() if k != "name"}
    return dataclasses.replace(from_mapping(RunConfig, data), policy=policy_config(str(policy["name"]), params))


def load_run_config(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Read a ``.toml``, ``.yaml``/``.yml`` or ``.json`` run file, apply dotted ``overrides``
    (``{"steps": 50, "policy.k0": 2e-3}``) and validate."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read run config {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{path}: unknown config format (use .toml, .yaml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return parse_run_config(_without_removed_fault_keys(data, stored=False))


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    if not all((*parents, leaf)):
        raise ConfigError(f"--set {dotted}: an empty part in the dotted key")
    for depth, key in enumerate(parents):
        data = data.setdefault(key, {})
        if not isinstance(data, dict):
            table = ".".join(parents[: depth + 1])
            raise ConfigError(f"--set {dotted}: {table} is a value ({data!r}), not a table with fields")
    data[leaf] = value


def check_relative_storage(storage: str, *, cwd: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """A relative ``storage`` under ``ray job submit`` is an error: it resolves against the job's
    working directory, which is Ray's unpacked ``--working-dir`` cache (or a directory Ray chose),
    and Ray deletes that cache: the checkpoints would go with it."""
    cwd = os.getcwd() if cwd is None else cwd
    environ = os.environ if environ is None else environ
    in_cache = RAY_WORKING_DIR_CACHE in cwd
    if not in_cache and RAY_JOB_ENV not in environ:
        return
    where = "Ray's working-dir cache, which Ray deletes" if in_cache else "the job's working directory, which Ray chose"
    raise ConfigError(
        f"storage: a relative path ({storage!r}) under a Ray job would put the checkpoints in {where} "
        f"({cwd}); use an absolute path on storage every node sees, or a URI (s3://, gs://), e.g. "
        f"--set storage=/shared/runs/{{name}}"
    )
