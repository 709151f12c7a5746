"""The configuration of one LayerCheck training run, read from TOML or YAML.

One table per component; every field is documented on its dataclass and validated when the
file is loaded, so a typo or a bad value fails on the driver with the field's dotted name
(``policy.k0: must be > 0``) before any worker starts. ``examples/`` has annotated files.
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

from layercheck.orchestrator.core.persistence.staleness_guard import BREACH_ACTIONS, DEFAULT_HUNG_WRITE_S
from layercheck.orchestrator.core.persistence.write_budget import WriteBudgetConfig
from layercheck.policies.config_loader import ConfigError, from_mapping, require, require_finite, to_mapping
from layercheck.policies.configs import (
    DEFAULT_POLICY,
    POLICY_CONFIGS,
    PolicyConfig,
    policy_config,
    policy_name,
    schedule_warnings,
)
from layercheck.policies.layer_map import LayerMap
from layercheck.workers.config import EngineConfig, ModelConfig, OptimConfig
from layercheck.workers.data.config import DataConfig, DataSummary

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
class PersistenceConfig:
    """The asynchronous writers that move layer snapshots to storage."""

    writers_per_node: int = 1
    """Writer actors per node; a rank uses writer ``rank % writers_per_node`` of its node."""
    max_inflight_bytes: int = 512 * 2**20
    """Per worker: snapshot bytes handed over but not yet written; past it the worker waits (a
    stall, counted in the metrics; logged at the first wait, then at most once a minute with how
    often and how long it waited)."""
    max_versions_in_flight: int = 2
    """Versions of one layer that may be handed over and not yet committed; the policy holds a
    layer back (defers it) while it has this many, so storage that falls behind lowers the save
    rate instead of piling up snapshots. Every version handed over is written by every rank."""
    fsync: bool = True
    """fsync each file before it is committed (local and NFS stores)."""
    save_final: bool = True
    """After the last step (or a requested stop), every layer's state at that step is persisted
    like any version, so the store holds the trained model and ``export`` writes it."""
    on_staleness_breach: str = "stop"
    """What a run does when storage failures (a full or read-only disk, an object-store outage),
    or storage that does not answer (``hung_write_s``), let a layer's staleness pass the policy's
    ``smax`` plus the pipeline lag: ``stop`` (stop the workers after the current step, persist
    what it can, report the error; resume once storage is fixed) or ``warn`` (keep training, log
    the error; the metric and alert fire). Storage that is merely slow (it writes, late) is no
    breach: a warning."""
    # Default "stop": the staleness bound is what LayerCheck promises. Training on past it means
    # the next worker failure rolls back further than the operator agreed to, for as long as the
    # storage stays broken (hours, on a week-long run nobody watches at night); a stopped run
    # loses nothing and resumes with one command. "warn" is for those who watch the alert.
    hung_write_s: float = DEFAULT_HUNG_WRITE_S
    """Seconds storage may leave the oldest version handed to the writers unanswered (neither
    committed nor failed, and nothing else committed meanwhile) before it counts as storage that
    does not answer: once a layer is past ``smax`` plus the lag, that is a breach
    (``on_staleness_breach``). The default is 4 requests (a shard's directory marker, upload and
    completion, and the version's commit) each as slow as LayerCheck's S3 client allows before it
    fails (3 attempts × (3 s connect + 5 s request timeout)); a slow store commits well within it."""
    stop_drain_s: float = 120.0
    """On a stop (Ctrl-C, a breach): how long the driver waits for the workers to finish their
    step. At every end, stopped or not: how long after the last step the ranks wait for their last
    snapshots to be written and the writers to commit what they hold; what is not written by then
    is counted lost (storage that hangs costs this long, not until it answers)."""
    capture: bool = True
    """When a worker dies, each surviving rank hands the slices it holds of every layer at its last
    step to its writer before it exits (persisted as a partial version), and recovery takes them
    over the stored versions: under ZeRO-3 only the dead ranks' slices come back stale, under
    ZeRO-0 nothing does. Ray Train's teardown of the broken group is held back for it (below)."""
    capture_grace_s: float = 2.0
    """How long the teardown waits for a survivor to begin its capture. An NCCL survivor blocked
    in a collective is released first (its process groups aborted, docs/recovery.md "GPU and NCCL"); one that
    still never begins contributes nothing: its slices come from stored versions."""
    capture_timeout_s: float = 30.0
    """The longest the teardown of a broken group is held for the survivors' captures."""
    memory_bytes: int = 2 * 2**30
    """Per writer: bytes of shard files kept in host memory after they are written (the newest
    version of each layer's shards; past the budget the oldest steps go first), so a recovery loads
    them from memory and reads storage only for what no writer holds. 0: off (recovery reads
    storage). Storage stays the source of truth: what is evicted is still recoverable from it."""
    memory_mirror: bool = True
    """Where the cluster has more than one node, each writer also sends its shard files to a writer
    on another node, which keeps them within its own ``memory_bytes``: a lost node's shards still
    load from memory. Costs one network copy of every byte written."""
    memory_period: int = 0
    """Every this many steps each rank also hands its slices of every layer to its writer as a
    *memory version*: held in the writers' memory (and mirrored to another node), never written to
    storage. A recovery takes a lost rank's slices from the newest of those and the stored versions,
    so they come back at most ``memory_period`` steps stale whatever the storage bandwidth. Costs a
    host copy of the rank's state per period and ``memory_bytes`` room for one such version of each
    layer (beside the stored versions' files). 0: off (needs ``memory_bytes`` > 0)."""
    write_budget: WriteBudgetConfig = field(default_factory=WriteBudgetConfig)
    """``[persistence.write_budget]``: the schedule's byte budget per step from the writers'
    measured drain bandwidth (headroom × bandwidth × step time, capped), so slow storage stretches
    the save periods instead of growing a queue."""

    def __post_init__(self) -> None:
        require(self.writers_per_node >= 1, "writers_per_node", ">= 1", self.writers_per_node)
        require(self.max_inflight_bytes >= 1, "max_inflight_bytes", ">= 1", self.max_inflight_bytes)
        require(self.max_versions_in_flight >= 1, "max_versions_in_flight", ">= 1", self.max_versions_in_flight)
        require(
            self.on_staleness_breach in BREACH_ACTIONS,
            "on_staleness_breach",
            " or ".join(repr(a) for a in BREACH_ACTIONS),
            self.on_staleness_breach,
        )
        require(self.hung_write_s > 0, "hung_write_s", "> 0", self.hung_write_s)
        require(self.stop_drain_s > 0, "stop_drain_s", "> 0", self.stop_drain_s)
        require(self.capture_grace_s >= 0, "capture_grace_s", ">= 0", self.capture_grace_s)
        require(self.capture_timeout_s > 0, "capture_timeout_s", "> 0", self.capture_timeout_s)
        require(self.memory_bytes >= 0, "memory_bytes", ">= 0 (0 turns the in-memory tier off)", self.memory_bytes)
        require(self.memory_period >= 0, "memory_period", ">= 0 (0 turns memory versions off)", self.memory_period)
        require(
            not self.memory_period or self.memory_bytes > 0,
            "memory_period",
            "0 while memory_bytes is 0 (memory versions live in the writers' memory tier)",
            self.memory_period,
        )

    @property
    def capture_hand_over_s(self) -> float | None:
        """How long a survivor waits for its writer to hold its capture (``None``: capture is off)."""
        return self.capture_timeout_s if self.capture else None

    @property
    def capture_hold_s(self) -> float | None:
        """The longest Ray Train's teardown is held for captures (``None``: capture is off)."""
        return self.capture_grace_s + self.capture_timeout_s if self.capture else None


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Failure injection, for demos and tests: SIGKILL one worker once, kill a writer, or stall
    the writers of one node (slow or hanging storage seen from that node)."""

    kill_at_step: int = 0
    """After this step completes, the worker of ``kill_rank`` kills itself (0: never)."""
    kill_rank: int = 0
    """The rank that is killed (a rank outside the group: none is, with a warning)."""
    kill_all_ranks: bool = False
    """Every rank kills itself after ``kill_at_step``, at once, once all have handed their
    snapshots over: the whole group is lost, no rank survives (``kill_rank`` aside)."""
    raise_at_step: int = 0
    """After this step completes, the worker of ``kill_rank`` raises an error of its own out of its
    loop, once (0: never): a bad batch or a bug on one rank, not a lost peer. Ray Train replaces
    that rank; in place, the others keep their processes."""
    kill_writer_at_step: int = 0
    """After this step, rank 0 kills its persistence writer actor, once (0: never)."""
    fail_in_place_recovery: bool = False
    """With ``cluster.in_place`` and ``kill_at_step``: the survivors' first recovery in their own
    process raises before it loads the composite, as a load that fails once would (the ranks other
    than ``kill_rank``, in their first incarnation after it). In-place recovery is then off, and
    Ray Train replaces every rank."""
    kill_again_in_recovery: bool = False
    """With ``kill_at_step`` or ``raise_at_step``: the replacement of the rank that failed
    (``kill_rank``) SIGKILLs itself too, during its recovery
    (after it joined the run and, in place, formed the new process group; before it loads the
    composite): a second failure during the recovery. Once: the next replacement recovers."""
    stall_writes_s: float = 0.0
    """Each shard write of a stalled writer pauses this long after its header, with its temporary
    file open, as on a storage mount that hangs (0: none). The writer writes one shard at a time,
    so what it is handed waits in its queue: versions held, not yet committed."""
    stall_writes_node: str = ""
    """The Ray node id (hex) whose writers stall; empty: every node's."""
    stall_writes_after_step: int = 0
    """Only shards of versions taken after this step stall (earlier ones, e.g. the first
    versions of every layer, are written at full speed)."""

    def fails_in_place_recovery(self, *, rank: int, incarnation: int) -> bool:
        """Whether ``rank``'s recovery in its own process, in ``incarnation``, raises (``fail_in_place_recovery``)."""
        return self.fail_in_place_recovery and incarnation == 1 and rank != self.kill_rank

    def kills_in_recovery(self, *, rank: int, attempt: int, incarnation: int) -> bool:
        """Whether ``rank``, a new process in the recovery of the first failure (``attempt`` 2),
        kills itself before its load (``kill_again_in_recovery``)."""
        return self.kill_again_in_recovery and rank == self.kill_rank and attempt == 2 and incarnation == 0

    def stall_s(self, *, node_id: str, step: int) -> float:
        """How long a writer on ``node_id`` stalls in its write of a shard taken at ``step``."""
        here = not self.stall_writes_node or self.stall_writes_node == node_id
        return self.stall_writes_s if here and step > self.stall_writes_after_step else 0.0

    def __post_init__(self) -> None:
        require(self.kill_at_step >= 0, "kill_at_step", ">= 0", self.kill_at_step)
        require(self.kill_writer_at_step >= 0, "kill_writer_at_step", ">= 0", self.kill_writer_at_step)
        require(self.kill_rank >= 0, "kill_rank", ">= 0", self.kill_rank)
        require_finite(self)
        require(self.stall_writes_s >= 0, "stall_writes_s", ">= 0", self.stall_writes_s)
        require(self.stall_writes_after_step >= 0, "stall_writes_after_step", ">= 0", self.stall_writes_after_step)


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


def check_data(config: RunConfig) -> DataSummary:
    """Read and check the run's data on the driver, before any worker starts: a malformed JSONL
    line, a missing chat template, an empty data set, a ``seq_len`` no example fits in, or a
    tokenizer larger than the model's vocabulary raises :class:`ConfigError`."""
    from layercheck.workers.data.dataset import load_data  # torch: only where the data is checked

    _, summary = load_data(config.data)
    vocab = _model_vocab_size(config)
    require(
        vocab is None or summary.vocab_size <= vocab,
        "model.hf_config.vocab_size" if config.model.hf_config else "model.path",
        f">= the tokenizer's vocabulary ({summary.vocab_size}, data.tokenizer = {config.data.tokenizer!r})",
        vocab,
    )
    return summary


def check_model(model: ModelConfig) -> LayerMap:
    """Build the model's layer map on the driver (no weights allocated), turning what would be a
    traceback in every worker into a :class:`ConfigError` naming the field: a ``model.path`` that
    is not a local checkpoint folder, an unknown ``model.hf_config.model_type``, a config
    ``transformers`` refuses, a model LayerCheck cannot map into layers."""
    field = "model.path" if model.path is not None else "model.hf_config"
    if model.path is not None:
        if not os.path.isdir(model.path):
            raise ConfigError(
                f"model.path: no directory {model.path!r} (a local checkpoint folder with "
                "config.json; LayerCheck downloads nothing)"
            )
        if not os.path.isfile(os.path.join(model.path, "config.json")):
            raise ConfigError(f"model.path: {model.path!r} has no config.json; is it a Hugging Face model folder?")
    else:
        from transformers import CONFIG_MAPPING

        model_type = (model.hf_config or {}).get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise ConfigError(
                f"model.hf_config.model_type: unknown model type {model_type!r}; transformers "
                "knows e.g. llama, qwen2, mistral, gpt2 (see transformers.CONFIG_MAPPING)"
            )
        field = "model.hf_config"
    from layercheck.workers.engine import layer_map_for  # torch and transformers: only when a run starts

    try:
        return layer_map_for(model)
    except Exception as error:  # transformers' own message, under the field that caused it
        raise ConfigError(f"{field}: cannot build the model: {type(error).__name__}: {error}") from None


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
    if fault.kill_at_step and not fault.kill_all_ranks and fault.kill_rank >= config.cluster.num_workers:
        # not an error: `--resume --set cluster.num_workers=1` of a demo run must work as written
        warnings.append(
            f"fault.kill_rank = {fault.kill_rank} is not a rank of the {config.cluster.num_workers}-"
            f"worker group: no failure is injected at step {fault.kill_at_step}"
        )
    return warnings


def _model_vocab_size(config: RunConfig) -> int | None:
    if config.model.hf_config is not None:
        vocab = config.model.hf_config.get("vocab_size")
        return int(vocab) if isinstance(vocab, int) else None
    from transformers import AutoConfig  # a local checkpoint's config.json

    assert config.model.path is not None  # ModelConfig holds exactly one of hf_config and path
    try:
        return int(AutoConfig.from_pretrained(config.model.path, local_files_only=True).vocab_size)
    except (OSError, ValueError, AttributeError):
        return None  # the engine build reports an unreadable checkpoint with its own message


def parse_run_config(data: Mapping[str, Any]) -> RunConfig:
    """A validated :class:`RunConfig` from parsed TOML/YAML/JSON."""
    data = dict(data)
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
    return parse_run_config(data)


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
