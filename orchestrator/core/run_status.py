"""The run's status, as one value: what the driver's progress line, the run's summary and the
metrics show. ``RunSupervisor.status`` builds it (the Ray-free view); the supervisor actor adds
what only the Ray runtime knows (the captures, a setup error, the spares).

Both travel as values (through Ray, between threads) and are read by attribute; ``as_dict`` gives
the JSON the run's result carries (``RunResult.status``), key for key and in the same order as the
dictionary this replaced."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LayerFigures:
    """One layer's committed versions: how many, their bytes, the newest one's step."""

    versions: int
    bytes: int
    last_step: int | None


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    run_id: str
    metrics_url: str | None
    state: str
    """The recovery machine's state name (``running``, ``recovering``, ``finished``, ``failed``, ...)."""
    attempt: int
    step: int
    loss: float
    lr: float
    step_s: float
    staleness: dict[str, int | None]
    """Per layer, steps since its newest committed version (``None``: none committed yet)."""
    max_staleness: int | None
    weighted_staleness: float | None
    layers: dict[str, LayerFigures]
    bytes_committed: int
    versions_committed: int
    partial_bytes_committed: int
    """The parts of incomplete versions that surviving ranks wrote, committed as partial versions
    (a recovery overlays them); not in the figures above, which are whole versions."""
    partial_versions_committed: int
    abandoned_versions: int
    lost_versions: int
    lost: list[str]
    """Why versions were lost, one line each."""
    commit_retries: int
    write_failures: int
    writers_replaced: int
    staleness_breach: dict[str, object] | None
    """``StalenessBreach.to_json`` of the breach, if storage broke ``smax``."""
    staleness_lag: dict[str, object] | None
    stop_reason: str | None
    write_latencies: list[float]
    account: dict[str, Any]
    """``RunAccount.summary``: ETTR, time per phase, recoveries, history. Kept as its JSON (read by
    key by the summary, the metrics and users' code through ``RunResult.status``); the supervisor
    actor adds the captures (``"capture"``)."""
    world_size: int
    grown_from: int
    memory_period: dict[str, object] | None
    """``MemoryPeriod.to_json`` of the period the run's memory versions follow (``None``: not told)."""
    setup_error: str | None = None
    """Why the run ended before its first step (the Ray runtime's ``SupervisorActor.setup_failed``)."""
    spares: dict[str, int] | None = None
    """``SpareRoster.view`` of a Ray run with warm spares (``None``: none)."""

    def as_dict(self) -> dict[str, object]:
        """The status as JSON, in the keys and order the run's result always had."""
        return asdict(self)
