"""``layercheck bench --scale``: the harness at each N of ``--ranks`` on one local multi-node
cluster, a table, and ``DIR/scale.json`` (``rows``: one :class:`~layercheck.bench.scale.harness.ScaleRow`
per N, with the run's config, the machine, and the plan over many committed versions)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layercheck.bench.scale.harness import LocalCluster, ScaleConfig, ScaleRow, run_scale

logger = logging.getLogger(__name__)

#: What every figure leaves out, printed beside the table and kept in ``scale.json``.
SCOPE = (
    "Ray Train's controller is not in the harness: ranks are protocols (many to a process), joined to "
    "the product's supervisor directly; ranks compute nothing, so a step is the protocol alone. "
    "Layer bytes are the model's divided by the scale factor; request counts and calls do not "
    "depend on it. One machine runs every node: absolute latencies measure it, growth with N and "
    "CPU per step measure the design."
)


def run_ranks(
    ranks: Sequence[int],
    base: ScaleConfig,
    *,
    work_dir: Path | None = None,
    out: Path | None = None,
    plan_versions: Sequence[int] = (),
) -> dict[str, Any]:
    """The harness at each of ``ranks`` (``base`` for the rest), then the plan over each of
    ``plan_versions`` committed versions; the report (written to ``out/scale.json`` as it grows)."""
    from layercheck.bench.machine import describe

    report: dict[str, Any] = {
        "config": dataclasses.asdict(base),
        "machine": describe(),
        "scope": SCOPE,
        "rows": [],
        "stopped": None,
        "plan_many": [],
    }
    root = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="lcscale-"))
    cluster = LocalCluster(nodes=base.nodes).start() if ranks else None
    try:
        for n in ranks:
            assert cluster is not None
            started = time.monotonic()
            try:
                row = run_scale(dataclasses.replace(base, ranks=n), root, cluster.worker_nodes)
            except Exception as error:  # noqa: BLE001 - say where it stopped, keep what was measured
                report["stopped"] = f"N={n}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
                logger.error("the harness stopped at N=%d: %s", n, error)
                break
            row.notes.append(f"wall {time.monotonic() - started:.0f}s")
            report["rows"].append(row.to_json())
            _write(report, out)
    finally:
        if cluster is not None:
            cluster.stop()
    if plan_versions:
        from layercheck.bench.scale.plan_many import plan_over_versions

        for versions in plan_versions:
            report["plan_many"].append(plan_over_versions(versions, shape=base.shape, scale=base.scale, root=root))
            _write(report, out)
    _write(report, out)
    return report


def _write(report: dict[str, Any], out: Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scale.json").write_text(json.dumps(report, indent=1, default=_finite))


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.1f}"


def table(report: dict[str, Any]) -> str:
    """The rows as a text table, with what the figures leave out."""
    head = (
        f"{'N':>5} {'policy':>8} {'superv.':>8} {'writers':>8} {'rank':>7} {'calls':>6} "
        f"{'decision':>17} {'waited':>7} {'commit':>19} {'late':>6} {'plan':>7} {'drain':>7} {'recover':>8} "
        f"{'versions':>8} {'store':>7} {'writer':>7}"
    )
    unit = (
        f"{'ranks':>5} {'ms CPU/step':>17} {'ms/step':>8} {'ms/r·s':>7} {'/r·s':>6} "
        f"{'ms med / p99':>17} {'ms/r·s':>7} {'ms med / p99':>19} {'s':>6} {'s':>7} {'of it':>7} {'s':>8} "
        f"{'':>8} {'req/st':>7} {'RSS MB':>7}"
    )
    lines = [head, unit]
    for row in report["rows"]:
        r = ScaleRow(**row)
        cpu = r.actor_cpu_ms_per_step
        calls = sum(v for k, v in r.calls_per_rank_per_step.items() if k != "receipts")
        decision = f"{_ms(r.decision_latency_ms['median'])} / {_ms(r.decision_latency_ms['p99'])}"
        commit = f"{_ms(r.commit_latency_ms['median'])} / {_ms(r.commit_latency_ms['p99'])}"
        recover = r.recovery_s.get("death_to_resume_s")
        lines.append(
            f"{r.n_ranks:>5} {cpu['policy']:>8.1f} {cpu['supervisor']:>8.1f} {cpu['writers']:>8.1f} "
            f"{r.host_cpu_ms_per_rank_step:>7.2f} {calls:>6.2f} {decision:>17} {r.waited_ms_per_step:>7.2f} "
            f"{commit:>19} {r.steps_late_s:>6.1f} {_ms(r.plan_s) if r.plan_s is not None else '-':>7} "
            f"{_ms(r.drain_s) if r.drain_s is not None else '-':>7} "
            f"{_ms(recover) if recover is not None else '-':>8} {r.versions:>8} "
            f"{sum(r.store_requests_per_step.values()):>7.1f} {r.writer_rss_bytes / 2**20:>7.0f}"
        )
    for row in report["rows"]:
        if faults := row.get("faults"):
            lines.append(
                f"N={row['n_ranks']}: {faults['writer_killed']} killed with {faults['queued_then']} snapshot(s) "
                f"queued; writers replaced {faults['writers_replaced']} "
                f"({faults['replaced_by_window_end']} by the window's end), versions lost {faults['lost_versions']}"
            )
    if report.get("stopped"):
        lines.append(f"stopped: {report['stopped']}")
    for plan in report.get("plan_many", ()):
        lines.append(
            f"plan over {plan['versions']:,} versions (N={plan['n_ranks']}): read {plan['read_s']:.2f}s "
            f"({plan['requests']['list']} LIST, {plan['requests']['get']} GET), plan {plan['plan_s']:.2f}s; "
            f"from the supervisor's own manifest: {plan['kept_plan_s']:.2f}s ({plan['kept_requests']['list']} LIST)"
        )
    lines.append(f"calls: per rank and step, all actors (receipts apart). {report['scope']}")
    return "\n".join(lines)
