"""The checkpointing strategies the benchmark compares, as values.

A strategy says *what* is persisted and *how a failure is recovered*; the harness
(:mod:`layercheck.bench.harness`) carries it out on LayerCheck's own loop and local runtime
(:mod:`layercheck.orchestrator.local`), the baselines' own checkpointing in :mod:`layercheck.bench.baselines`. Every strategy trains the same workload with the same
failure schedule, so their rows differ only in checkpointing.

=============== ============================================ =====================================
name            persists                                     recovery
=============== ============================================ =====================================
none            nothing                                      restart from step 0 (rollback)
full            DeepSpeed ``save_checkpoint`` every N, sync  ``load_checkpoint``, re-run lost steps
full-async      the same bytes, written by a thread          the same
full-resume     every layer every N (LayerStore, async)      composite, resume at ``t_fail + 1``
staggered       the default schedule: every layer every ~N,   composite, resume at ``t_fail + 1``
                phases spread, drift-aware periods, a byte
                budget of (changing bytes)/N per step, drift
                measured every 10th step
staggered       the same, drift measured at every step        the same
@drift1
layercheck      the paper's policy (LayerStore, async)       composite, resume at ``t_fail + 1``
layercheck      the same, and the survivors' capture at a    composite with the survivors'
+capture        failure (partial versions)                   slices overlaid, ``t_fail + 1``
layercheck      the same, and the writers keep the newest    the same composite, its shard files
+capture        shard files in host memory (memory tier)     opened from the writers' memory
+memory                                                      before storage
drift-optimal   per-layer period ~ 1/sqrt(drift), mean N     composite, resume at ``t_fail + 1``
diff            every layer every N + per-step top-k delta   last full + replay of the deltas
=============== ============================================ =====================================

Under ``--engine fsdp2`` DeepSpeed's ``full`` and ``full-async`` have no engine to call; the
FSDP2 user's own full checkpoints take their place (:mod:`layercheck.bench.dcp_baseline`):

=============== ============================================ =====================================
dcp             ``torch.distributed.checkpoint.save`` of     ``dcp.load``, re-run lost steps
                ``get_state_dict(model, optimizer)`` every
                N, on the training thread
dcp-async       the same with ``dcp.async_save``: staged to  the same
                host memory (pinned, on a GPU) on the
                training thread, written by a thread
=============== ============================================ =====================================

A failure is a fail-stop of the last rank (:func:`layercheck.orchestrator.local.run.train_with_failures`);
the recovery tiers above storage a resuming strategy uses are its :class:`Tier` s (``+capture``,
``+memory``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from layercheck.policies.config_loader import to_mapping
from layercheck.policies.configs import (
    DriftOptimalConfig,
    IntervalConfig,
    LayerCheckConfig,
    NeverConfig,
    PolicyConfig,
    StaggeredConfig,
    policy_config,
    policy_name,
)

#: The layer-wise policies a strategy may run (``layer-policy``).
LayerPolicy = LayerCheckConfig | DriftOptimalConfig | StaggeredConfig


class Kind(str, enum.Enum):
    """How state is persisted."""

    NONE = "none"
    DEEPSPEED_SYNC = "deepspeed-sync"  # engine.save_checkpoint on the training thread
    DEEPSPEED_ASYNC = "deepspeed-async"  # same files; host copy on the thread, writes in the background
    DCP_SYNC = "dcp-sync"  # torch.distributed.checkpoint.save on the training thread (FSDP2)
    DCP_ASYNC = "dcp-async"  # dcp.async_save: staged on the thread, written in the background (FSDP2)
    LAYER_INTERVAL = "layer-interval"  # every layer every N steps through the LayerStore
    LAYER_POLICY = "layer-policy"  # the LayerCheck policy through the LayerStore
    DIFFERENTIAL = "differential"  # LayerStore full every N + compressed per-step deltas


class Recovery(str, enum.Enum):
    """How a failure is recovered."""

    RESTART = "restart"  # from the initial weights: every step is lost
    ROLLBACK = "rollback"  # load the last full checkpoint, re-run the steps since
    RESUME = "resume"  # load the composite, continue at t_fail + 1
    REPLAY_DELTAS = "replay-deltas"  # load the last full, apply the deltas up to t_fail


class Tier(str, enum.Enum):
    """A recovery tier above storage (docs/recovery.md, "Recovery from memory") that a resuming strategy uses."""

    CAPTURE = "capture"
    """The survivors' own slices at ``t_fail`` (:mod:`layercheck.workers.capture`), persisted as partial
    versions and overlaid on the composite: ``LocalCoordinator(capture=True)``."""
    MEMORY = "memory"
    """The writers' host memory: each rank's writer keeps the newest shard files it wrote
    (``persistence.memory_bytes``, the product's default budget) and the recovery opens them from
    there before storage (:mod:`layercheck.orchestrator.local.memory`): ``LocalCoordinator(memory_bytes=...)``.
    It changes where the recovery's bytes come from and how long the load takes, never what is
    loaded."""


RECOVERY_OF: Mapping[Kind, Recovery] = {
    Kind.NONE: Recovery.RESTART,
    Kind.DEEPSPEED_SYNC: Recovery.ROLLBACK,
    Kind.DEEPSPEED_ASYNC: Recovery.ROLLBACK,
    Kind.DCP_SYNC: Recovery.ROLLBACK,
    Kind.DCP_ASYNC: Recovery.ROLLBACK,
    Kind.LAYER_INTERVAL: Recovery.RESUME,
    Kind.LAYER_POLICY: Recovery.RESUME,
    Kind.DIFFERENTIAL: Recovery.REPLAY_DELTAS,
}

#: Strategies whose recovery state is an interval of full checkpoints, run again at matched freshness
#: (under FSDP2 the user's baseline is DCP's asynchronous save, so it is the one matched).
MATCHABLE: tuple[Kind, ...] = (Kind.DEEPSPEED_SYNC, Kind.DCP_ASYNC, Kind.LAYER_INTERVAL, Kind.DIFFERENTIAL)
#: Of those, the ones that write nothing but full checkpoints, run again at matched bytes (``diff``'s
#: per-step deltas make its bytes no multiple of one checkpoint).
BYTES_MATCHABLE: tuple[Kind, ...] = (Kind.DEEPSPEED_SYNC, Kind.DCP_ASYNC, Kind.LAYER_INTERVAL)
#: The engine-bound baselines: the engine whose own checkpoint call each needs.
ENGINE_OF: Mapping[Kind, str] = {
    Kind.DEEPSPEED_SYNC: "deepspeed",
    Kind.DEEPSPEED_ASYNC: "deepspeed",
    Kind.DCP_SYNC: "fsdp2",
    Kind.DCP_ASYNC: "fsdp2",
}
#: Each engine's full-checkpoint baselines (name -> what it calls), for the refusals.
ENGINE_BASELINES: Mapping[str, Mapping[str, str]] = {
    "deepspeed": {
        "full": "DeepSpeed's engine.save_checkpoint",
        "full-async": "DeepSpeed's save_checkpoint with an asynchronous checkpoint engine",
    },
    "fsdp2": {
        "dcp": "torch.distributed.checkpoint.save",
        "dcp-async": "torch.distributed.checkpoint.async_save",
    },
}
#: What a matched variant was matched on, and its name suffix.
MATCHED_ON: Mapping[str, str] = {"staleness": "stal", "drift": "drift", "bytes": "bytes"}


@dataclass(frozen=True, kw_only=True)
class Strategy:
    name: str
    """The row label (unique within a run)."""
    kind: Kind
    interval: int = 0
    """Steps between full checkpoints (the full-checkpoint kinds and ``differential``)."""
    policy: LayerPolicy | None = None
    """The layer-wise policy (``layer-policy`` only): the staggered default, the paper's, or drift-optimal."""
    delta_density: float = 0.01
    """``differential``: fraction of each state tensor's elements sent per step (top-k with error feedback)."""
    matched: str = ""
    """For a matched variant: ``staleness`` or ``drift`` (LayerCheck's freshness), or ``bytes``
    (the bytes LayerCheck wrote): what its interval was matched on."""
    tiers: tuple[Tier, ...] = ()
    """Recovery tiers above storage (resuming strategies only): ``capture``, ``memory``."""
    memory_period: int = 0
    """With the ``memory`` tier: steps between memory versions (``persistence.memory_period``:
    every layer held in the writers' memory, never stored); 0: none."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Strategy.name: must be non-empty")
        needs_interval = self.kind in (
            Kind.DEEPSPEED_SYNC,
            Kind.DEEPSPEED_ASYNC,
            Kind.DCP_SYNC,
            Kind.DCP_ASYNC,
            Kind.LAYER_INTERVAL,
            Kind.DIFFERENTIAL,
        )
        if needs_interval and self.interval < 1:
            raise ValueError(
                f"Strategy {self.name}: interval must be >= 1 for kind {self.kind.value}, got {self.interval}"
            )
        if (self.kind is Kind.LAYER_POLICY) != (self.policy is not None):
            raise ValueError(
                f"Strategy {self.name}: a layer-wise policy config (staggered, layercheck, "
                "drift-optimal) is needed for, and only for, kind layer-policy"
            )
        if not 0 < self.delta_density <= 1:
            raise ValueError(f"Strategy {self.name}: delta_density must be in (0, 1], got {self.delta_density}")
        if self.matched and self.matched not in MATCHED_ON:
            raise ValueError(
                f"Strategy {self.name}: matched must be '' or one of {list(MATCHED_ON)}, got {self.matched!r}"
            )
        if self.tiers and self.recovery is not Recovery.RESUME:
            raise ValueError(f"Strategy {self.name}: tiers need a resuming strategy, not {self.recovery.value}")
        if len(set(self.tiers)) != len(self.tiers) or not all(isinstance(t, Tier) for t in self.tiers):
            raise ValueError(f"Strategy {self.name}: tiers must be distinct of {[t.value for t in Tier]}")
        if self.memory_period < 0 or (self.memory_period and Tier.MEMORY not in self.tiers):
            raise ValueError(f"Strategy {self.name}: memory_period needs the memory tier and must be >= 0")

    @property
    def recovery(self) -> Recovery:
        return RECOVERY_OF[self.kind]

    @property
    def capture(self) -> bool:
        return Tier.CAPTURE in self.tiers

    @property
    def memory(self) -> bool:
        return Tier.MEMORY in self.tiers

    @property
    def loop_policy(self) -> PolicyConfig:
        """The policy LayerCheck's loop runs for this strategy: its own (``layer-policy``), every
        layer every N (``layer-interval`` and the full part of ``differential``), or never (the
        DeepSpeed and DCP baselines and ``none``, whose checkpointing is their own)."""
        if self.policy is not None:
            return self.policy
        if self.kind in (Kind.LAYER_INTERVAL, Kind.DIFFERENTIAL):
            return IntervalConfig(interval=self.interval)
        return NeverConfig()

    @property
    def uses_layer_store(self) -> bool:
        return self.kind in (Kind.LAYER_INTERVAL, Kind.LAYER_POLICY, Kind.DIFFERENTIAL)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "recovery": self.recovery.value,
            "interval": self.interval,
            "delta_density": self.delta_density,
            "matched": self.matched,
            "policy": _policy_json(self.policy),
            "tiers": [t.value for t in self.tiers],
            "memory_period": self.memory_period,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Strategy:
        policy = _policy_from_json(data.get("policy"))
        return cls(
            name=data["name"],
            kind=Kind(data["kind"]),
            interval=int(data["interval"]),
            policy=policy,
            delta_density=float(data["delta_density"]),
            matched=data.get("matched", ""),
            tiers=tuple(Tier(t) for t in data.get("tiers", ())),
            memory_period=int(data.get("memory_period", 0)),
        )


def _policy_json(policy: LayerPolicy | None) -> dict[str, Any] | None:
    return None if policy is None else {"type": policy_name(policy), **to_mapping(policy)}


def _policy_from_json(data: Mapping[str, Any] | None) -> LayerPolicy | None:
    if not data:
        return None
    policy = policy_config(data.get("type", "layercheck"), {k: v for k, v in data.items() if k != "type"})
    assert isinstance(policy, (LayerCheckConfig, DriftOptimalConfig, StaggeredConfig)), policy  # a LayerPolicy
    return policy


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """The knobs that shape the default set."""

    interval: int = 50
    """N: steps between full checkpoints for the fixed-interval baselines."""
    layercheck_warmup: int = 40
    """LayerCheck's warm-up W (base checkpoint at W); the paper's 200 is longer than the CPU run."""
    layercheck: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of ``LayerCheckConfig`` beyond the defaults (empty: the project's defaults)."""
    delta_density: float = 0.01
    min_matched_interval: int = 1
    """Floor of the matched intervals (a time and disk guard for large models; the report says
    when it was applied)."""
    memory_period: int = 5
    """``layercheck+capture+memory@P``: steps between its memory versions."""


def layercheck_configs(options: StrategyOptions) -> dict[str, LayerCheckConfig]:
    base = {**to_mapping(LayerCheckConfig()), "warmup_steps": options.layercheck_warmup, **options.layercheck}
    return {
        "layercheck": LayerCheckConfig(**base),
        "layercheck-const": LayerCheckConfig(**{**base, "threshold_schedule": "constant"}),
    }


def full_baselines(interval: int, engine: str = "deepspeed") -> list[Strategy]:
    """The engine's own full checkpoints every ``interval`` steps, with rollback: DeepSpeed's
    ``save_checkpoint`` (``full``, ``full-async``), or for FSDP2 DCP's ``save`` and ``async_save``
    (``dcp``, ``dcp-async``)."""
    if engine == "fsdp2":
        return [
            Strategy(name="dcp", kind=Kind.DCP_SYNC, interval=interval),
            Strategy(name="dcp-async", kind=Kind.DCP_ASYNC, interval=interval),
        ]
    return [
        Strategy(name="full", kind=Kind.DEEPSPEED_SYNC, interval=interval),
        Strategy(name="full-async", kind=Kind.DEEPSPEED_ASYNC, interval=interval),
    ]


def default_strategies(options: StrategyOptions, engine: str = "deepspeed") -> list[Strategy]:
    """The strategies of a benchmark run on ``engine``, ``none`` first (it is the reference)."""
    n = options.interval
    out = [
        Strategy(name="none", kind=Kind.NONE),
        *full_baselines(n, engine),
        Strategy(name="full-resume", kind=Kind.LAYER_INTERVAL, interval=n),
    ]
    # the default schedule at the baselines' mean period, starting at the paper policy's warm-up step
    out.append(
        Strategy(
            name="staggered",
            kind=Kind.LAYER_POLICY,
            policy=StaggeredConfig(period=n, warmup_steps=options.layercheck_warmup),
        )
    )
    # the same measuring drift at every step (drift_every = 1), what it did before sampling: the
    # probe's price beside it
    out.append(
        Strategy(
            name="staggered@drift1",
            kind=Kind.LAYER_POLICY,
            policy=StaggeredConfig(period=n, warmup_steps=options.layercheck_warmup, drift_every=1),
        )
    )
    configs = layercheck_configs(options)
    out += [Strategy(name=name, kind=Kind.LAYER_POLICY, policy=cfg) for name, cfg in configs.items()]
    # the paper's policy again with the survivors' capture: same writes, fresher slices at recovery
    out.append(
        Strategy(name="layercheck+capture", kind=Kind.LAYER_POLICY, policy=configs["layercheck"], tiers=(Tier.CAPTURE,))
    )
    # and with the memory tier: the same state recovered, its files from the writers' memory
    out.append(
        Strategy(
            name="layercheck+capture+memory",
            kind=Kind.LAYER_POLICY,
            policy=configs["layercheck"],
            tiers=(Tier.CAPTURE, Tier.MEMORY),
        )
    )
    # and with memory versions: the lost rank's slices from a state at most memory_period steps old
    out.append(
        Strategy(
            name=f"layercheck+capture+memory@{options.memory_period}",
            kind=Kind.LAYER_POLICY,
            policy=configs["layercheck"],
            tiers=(Tier.CAPTURE, Tier.MEMORY),
            memory_period=options.memory_period,
        )
    )
    out.append(
        Strategy(
            name="drift-optimal",
            kind=Kind.LAYER_POLICY,
            policy=DriftOptimalConfig(period=n, warmup_steps=options.layercheck_warmup),
        )
    )
    out.append(Strategy(name="diff", kind=Kind.DIFFERENTIAL, interval=n, delta_density=options.delta_density))
    return out


def matched_variants(
    strategies: list[Strategy],
    *,
    staleness_interval: int,
    drift_interval: int,
    bytes_intervals: Mapping[str, int] | None = None,
) -> list[Strategy]:
    """The matchable baselines again, at the interval matching LayerCheck's weighted staleness
    and at the one matching its mean unsaved drift (``name@stal``, ``name@drift``); and each one
    named in ``bytes_intervals`` at its own interval writing LayerCheck's bytes (``name@bytes``;
    :mod:`layercheck.bench.matched`)."""
    bytes_intervals = bytes_intervals or {}
    out = []
    for s in strategies:
        if s.kind not in MATCHABLE or s.matched:
            continue
        at = {"staleness": staleness_interval, "drift": drift_interval}
        if s.kind in BYTES_MATCHABLE and s.name in bytes_intervals:
            at["bytes"] = bytes_intervals[s.name]
        out += [replace(s, name=f"{s.name}@{MATCHED_ON[on]}", interval=n, matched=on) for on, n in at.items()]
    return out


def select(strategies: list[Strategy], names: list[str] | None, *, engine: str = "deepspeed") -> list[Strategy]:
    """The strategies named (in the given order, ``none`` always first), or all of them. A
    baseline of another engine than ``engine`` is refused naming its counterpart here."""
    if not names:
        return strategies
    by_name = {s.name: s for s in strategies}
    for other, baselines in ENGINE_BASELINES.items():
        foreign = [n for n in names if n in baselines and n not in by_name and other != engine]
        if foreign:
            ours = ", ".join(f"{n} ({what})" for n, what in ENGINE_BASELINES.get(engine, {}).items())
            raise ValueError(
                f"{', '.join(foreign)}: {' and '.join(baselines[n] for n in foreign)}, which needs the {other} "
                f"engine; with --engine {engine} the full-checkpoint baselines are {ours or 'none'}"
            )
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {sorted(by_name)}")
    chosen = ["none"] + [n for n in names if n != "none"]
    return [by_name[n] for n in chosen]
