"""The closing summary of a training run: what it trained, what failed and how it recovered,
what it wrote against what full checkpoints would have written, and its ETTR. Shared by
``layercheck train`` and ``layercheck.LayerCheckTrainer``."""

from __future__ import annotations

import logging
import math
from typing import Any

from layercheck.orchestrator.core.accounting import ELEMENT_KINDS
from layercheck.orchestrator.core.memory.auto_period import MemoryPeriod
from layercheck.orchestrator.core.recovery.capture_window import capture_figures
from layercheck.orchestrator.runtime.progress_lines import short_number
from layercheck.orchestrator.runtime.recovery_lines import period_check, recovered, recovery_rows
from layercheck.orchestrator.runtime.run_end import RunResult
from layercheck.orchestrator.store.uri import redact_uri
from layercheck.orchestrator.table import format_table, human_bytes
from layercheck.policies.configs import DriftOptimalConfig, LayerCheckConfig, StaggeredConfig, policy_name
from layercheck.policies.layer_map import describe_layers
from layercheck.policies.simulation import BYTES_PER_PARAM, compare


def summarize(result: RunResult) -> dict[str, Any]:
    status = result.status
    if "account" not in status:  # the supervisor could not be asked at the end (see end_errors)
        return {
            "run_id": result.run_id,
            "state": "unknown",
            "error": result.error,
            "storage": redact_uri(result.storage_uri),
            "end_errors": list(result.end_errors),
            "interrupted": result.interrupted,
        }
    account = status["account"]
    full_bytes = sum(result.layer_numel.values()) * BYTES_PER_PARAM
    period = _memory_period(status, result.memory_period)
    summary: dict[str, Any] = {
        "run_id": result.run_id,
        "state": status["state"],
        "error": result.error,
        "steps": status["step"],
        "final_loss": status["loss"],
        "failures": account["failures"],
        "recoveries": account["recoveries"],
        "capture": capture_figures(account.get("capture", {})),
        "recovered_elements": account.get("recovered_elements", dict.fromkeys(ELEMENT_KINDS, 0)),
        "bytes_written": status["bytes_committed"],
        "versions_written": status["versions_committed"],
        "partial_bytes_written": status.get("partial_bytes_committed", 0),
        "partial_versions_written": status.get("partial_versions_committed", 0),
        "full_checkpoint_bytes": full_bytes,
        "max_staleness": status["max_staleness"],
        "weighted_staleness": status["weighted_staleness"],
        "ettr": account["ettr"],
        "wall_s": account["wall_s"],
        "productive_s": account["productive_s"],
        "stall_s": account["stall_s"],
        "coordination_s_per_step": account["coordination_s_per_step"],
        "drift_probe": account.get("drift_probe"),
        "engine": account.get("engine") or "",
        "step_s_per_step": account["step_s_per_step"],
        "write_failures": status["write_failures"],
        "commit_retries": status.get("commit_retries", 0),
        "lost_versions": status.get("lost_versions", 0),
        "lost": list(status.get("lost", [])),
        "writers_replaced": status.get("writers_replaced", 0),
        "memory": status.get("memory") or {},
        "memory_period": period.period,
        "memory_period_choice": period.to_json(),
        "memory_period_checks": _period_checks(account.get("recoveries", []), period),
        "staleness_breach": status.get("staleness_breach"),
        "staleness_lag": status.get("staleness_lag"),
        "stop_reason": status.get("stop_reason"),
        "interrupted": result.interrupted,
        "end_errors": list(result.end_errors),
        "storage": redact_uri(result.storage_uri),
        "metrics_url": result.metrics_url,
        "stored": status.get("stored"),
        "save_final": result.config.persistence.save_final if result.config is not None else True,
        "spares": _spares_figures(status.get("spares"), result),
    }
    summary.update(_schedule_figures(result.schedule, full_bytes))
    policy = result.policy
    assert policy is not None  # start_run's policy config (RunResult takes the run config's otherwise)
    if policy.selective and result.trace.steps:
        logging.getLogger("layercheck.policies").setLevel(logging.WARNING)  # the replay's decisions are not news
        warmup = (
            policy.warmup_steps if isinstance(policy, (LayerCheckConfig, DriftOptimalConfig, StaggeredConfig)) else 0
        )
        comparison = compare(result.trace, policy, label=policy_name(policy), eval_from=warmup)
        ours, staleness, drift = comparison.result, comparison.matched_staleness, comparison.matched_drift
        summary["full_at_same_staleness"] = {
            "interval": staleness.interval,
            "bytes": staleness.bytes_written,
            "mean_weighted_staleness": staleness.mean_weighted_staleness,
            "policy_mean_weighted_staleness": ours.mean_weighted_staleness,
        }
        summary["full_at_same_drift"] = {
            "interval": drift.interval,
            "bytes": drift.bytes_written,
            "mean_unsaved_drift": drift.mean_unsaved_drift,
            "policy_mean_unsaved_drift": ours.mean_unsaved_drift,
        }
        if result.trace.sampled:  # the unsaved drift between measurements is the rate's estimate
            summary["drift_measured_steps"] = sum(1 for o in result.trace.steps if o.measured)
    return summary


def _memory_period(status: dict[str, Any], configured: int) -> MemoryPeriod:
    """The memory versions' period the run used and why: the supervisor's (``"auto"``: the one it
    chose), else ``configured`` (a status from before the supervisor said)."""
    told = status.get("memory_period")
    if told:
        return MemoryPeriod.from_json(told)
    why = f"every {configured} step{'s' if configured != 1 else ''}" if configured else "off"
    return MemoryPeriod(period=configured, start=configured, why=f"{why} (persistence.memory_period = {configured})")


def _period_checks(recoveries: list[dict[str, Any]], period: MemoryPeriod) -> list[dict[str, Any]]:
    """Per recovery from a failure, whether it kept ``persistence.memory_period`` (the period in
    force at its ``t_fail``; none without one)."""
    return [check.to_json() for r in recoveries if (check := period_check(r, period.at(r["t_fail"]))) is not None]


def _spares_figures(spares: dict[str, Any] | None, result: Any) -> dict[str, Any] | None:
    """What the warm spares (``cluster.spares``) cost and did: idle workers held for the run."""
    if not spares or result.config is None:
        return None
    cluster = result.config.cluster
    return {
        **spares,
        "training_workers": cluster.num_workers,
        "cpus_per_worker": cluster.cpus_per_worker,
        "gpus_per_worker": 1 if cluster.use_gpu else 0,
    }


def _schedule_figures(schedule: dict[str, Any], full_bytes: int) -> dict[str, Any]:
    """Peak bytes handed over in one step (beside a full checkpoint) and the write budget, from
    the policy actor's ``schedule_view`` (absent when it could not be read)."""
    if not schedule:
        return {}
    peak = schedule.get("peak_step_bytes")
    return {
        "peak_step_bytes": peak,
        "peak_step": schedule.get("peak_step"),
        "peak_step_fraction_of_full": peak / full_bytes if peak is not None and full_bytes else None,
        "schedule_bytes": schedule.get("handed_bytes"),
        "write_budget_bytes_per_step": schedule.get("write_budget_bytes"),
        "drain_bytes_per_second": schedule.get("drain_bytes_per_second"),
        "write_budget_enabled": schedule.get("write_budget_enabled"),
    }


def format_summary(summary: dict[str, Any]) -> str:
    if "steps" not in summary:
        return format_table(
            ["", ""],
            [
                ["run", summary["run_id"]],
                ["state", f"unknown ({summary['error'] or 'ok'})"],
                *_trouble_rows(summary),
                ["storage", summary["storage"]],
            ],
        )
    rows: list[list[object]] = [
        ["run", summary["run_id"]],
        ["state", _state(summary)],
        *([["engine", ENGINE_NAMES.get(summary["engine"], summary["engine"])]] if summary.get("engine") else []),
        ["steps", summary["steps"]],
        ["final loss", short_number(summary["final_loss"])],
        ["failures / recoveries", f"{summary['failures']} / {sum(recovered(r) for r in summary['recoveries'])}"],
    ]
    rows += recovery_rows(summary)
    rows += _stored_rows(summary)
    rows += [
        [
            "bytes written",
            f"{human_bytes(summary['bytes_written'])} in {summary['versions_written']} layer versions "
            f"(one full checkpoint: {human_bytes(summary['full_checkpoint_bytes'])}){_partial(summary)}",
        ],
    ]
    if not summary["steps"] and not summary["recoveries"]:  # it never trained: no schedule, staleness, ETTR
        rows += [*_trouble_rows(summary), ["storage", summary["storage"]]]
        return format_table(["", ""], rows)
    rows += _schedule_rows(summary)
    rows += _memory_period_rows(summary)
    rows += _memory_rows(summary)
    rows += _host_memory_rows(summary)
    rows += _matched_rows(summary)
    rows += [
        [
            "staleness now (max / weighted)",
            f"{summary['max_staleness']} / {short_number(summary['weighted_staleness'])}",
        ],
        [
            "ETTR",
            f"{summary['ettr']:.3f} ({summary['productive_s']:.1f}s productive of {summary['wall_s']:.1f}s; "
            f"checkpoint stalls {summary['stall_s']:.2f}s)",
        ],
        ["policy protocol per step", _protocol_cost(summary)],
        *_probe_rows(summary),
        [
            "write failures / commit retries / lost versions",
            f"{summary['write_failures']} / {summary['commit_retries']} / {summary['lost_versions']}",
        ],
        *_trouble_rows(summary),
        ["storage", summary["storage"]],
    ]
    if summary.get("metrics_url"):
        rows.append(["metrics", f"{summary['metrics_url']} (Prometheus; served while the run was live)"])
    return format_table(["", ""], rows)


#: How the summary names each engine the ranks report (:data:`layercheck.workers.engines.base.ENGINE_KINDS`).
ENGINE_NAMES = {"deepspeed": "DeepSpeed", "fsdp2": "PyTorch FSDP2 (fully_shard)"}


def _matched_rows(summary: dict[str, Any]) -> list[list[object]]:
    """Full checkpoints at the run's freshness, against what the schedule handed over (12 bytes
    a parameter, as they count; without the final save, which full checkpoints would make too),
    or against the bytes written when that is unknown."""
    ours = summary.get("schedule_bytes")
    what = "the schedule handed over" if ours is not None else "the policy wrote"
    ours = ours if ours is not None else summary["bytes_written"]
    rows: list[list[object]] = []
    sampled = summary.get("drift_measured_steps")
    for key, label in (("full_at_same_staleness", "staleness"), ("full_at_same_drift", "unsaved drift")):
        matched = summary.get(key)
        if not matched:
            continue
        if key == "full_at_same_drift" and sampled is not None:
            label += f" (drift measured at {sampled} steps, the others estimated)"
        ratio = ours / matched["bytes"] if matched["bytes"] else math.inf
        rows.append(
            [
                f"full checkpoints, same {label}",
                f"every {matched['interval']} steps: {human_bytes(matched['bytes'])} ({what} {ratio:.2f}x that)",
            ]
        )
    return rows


def _memory_period_rows(summary: dict[str, Any]) -> list[list[object]]:
    """The memory versions' period and why (``"auto"``: what it was chosen from)."""
    choice = summary.get("memory_period_choice")
    return [["memory versions", choice["why"]]] if choice else []


def _memory_rows(summary: dict[str, Any]) -> list[list[object]]:
    memory = summary.get("memory") or {}
    if not memory:
        return []
    if not memory.get("budget_bytes_per_writer"):
        return [["recovery memory", "off (persistence.memory_bytes = 0): recovery reads storage"]]
    return [
        [
            "recovery memory (writers)",
            f"{human_bytes(memory['held_bytes'])} in {memory['held_shards']} shard files over {memory['writers']} "
            f"writer(s) (budget {human_bytes(memory['budget_bytes_per_writer'])} each; "
            f"{human_bytes(memory['mirror_bytes'])} mirror copies"
            f"{'' if memory.get('mirror') else ', mirroring off'}); {memory['evicted_shards']} evicted"
            + _memory_versions_dropped(memory),
        ]
    ]


def _host_memory_rows(summary: dict[str, Any]) -> list[list[object]]:
    """What the writers' processes hold, by kind (``core/memory/footprint.py``): their own resident
    memory against runtime + held + in flight, and the object store's shared pages apart."""
    host = (summary.get("memory") or {}).get("host") or {}
    if not host or host.get("own_bytes_max") is None:
        return []
    held = host["memory_version_bytes"] + host["stored_copy_bytes"] + host["mirror_bytes"]
    in_flight = host["encoding_bytes"] + host["capture_copy_bytes"]
    return [
        [
            "writer host memory",
            f"own RSS {human_bytes(host['own_bytes_max'])} (peak {human_bytes(host['peak_own_bytes_max'])}) "
            f"for the largest of {host['writers']} writer(s); all writers: runtime "
            f"{human_bytes(host['runtime_bytes_max'])} each + held {human_bytes(held)} (memory versions "
            f"{human_bytes(host['memory_version_bytes'])}, copies of stored files "
            f"{human_bytes(host['stored_copy_bytes'])}, mirror copies {human_bytes(host['mirror_bytes'])}) + in "
            f"flight {human_bytes(in_flight)}; not accounted for: {human_bytes(host['unaccounted_bytes_max'])} "
            f"(at most {human_bytes(host['peak_unaccounted_bytes_max'])}); plus Ray object-store pages mapped "
            f"{human_bytes(host['shmem_bytes_max'])} (the node's shared object store, counted there)",
        ]
    ]


def _memory_versions_dropped(memory: dict[str, Any]) -> str:
    """The memory versions' shards the writers let go for their budget (``core/memory/tier.py``)."""
    dropped = memory.get("memory_versions_dropped", 0)
    if not dropped:
        return ""
    return (
        f", {dropped} of them memory versions' (persistence.memory_bytes cannot hold a whole memory version: "
        "persistence.memory_period not kept for those layers)"
    )


def _schedule_rows(summary: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    if summary.get("peak_step_bytes") is not None:
        fraction = summary.get("peak_step_fraction_of_full")
        rows.append(
            [
                "peak bytes in one step",
                f"{human_bytes(summary['peak_step_bytes'])} at step {summary.get('peak_step') or '-'}"
                + (f" ({fraction:.2f} of a full checkpoint)" if fraction is not None else ""),
            ]
        )
    if summary.get("write_budget_enabled"):
        budget, drain = summary.get("write_budget_bytes_per_step"), summary.get("drain_bytes_per_second")
        rows.append(
            [
                "write budget",
                "not measured yet (no write finished)"
                if budget is None
                else f"{human_bytes(budget)}/step (writers drain {human_bytes(drain or 0)}/s)",
            ]
        )
    return rows


def _state(summary: dict[str, Any]) -> str:
    if summary.get("stop_reason"):
        return f"stopped after step {summary['steps']} ({summary['stop_reason']})"
    return summary["state"] + (f" ({summary['error']})" if summary["error"] else "")


def _stored_rows(summary: dict[str, Any]) -> list[list[object]]:
    """What the store holds at the end, said plainly when it is not the run's last state."""
    stored = summary.get("stored")
    if not stored or not summary.get("steps"):
        return []
    if not stored["older"]:
        return [["stored at the end", f"every layer at step {stored['step']}"]]
    newest = stored["newest_recoverable_step"]
    gets = (
        f"export and --resume take the composite at step {newest}, those layers from older versions"
        if newest is not None
        else "nothing is recoverable"
    )
    head = "NOT the final state: " if summary.get("save_final") else ""
    return [
        [
            "stored at the end",
            f"{head}{stored['layers_at_step']} of {stored['layers']} layers at step {stored['step']}, "
            f"{describe_layers(stored['older'])} older; {gets}",
        ]
    ]


def _trouble_rows(summary: dict[str, Any]) -> list[list[object]]:
    """What went wrong with persistence or at the end, each on a row of its own (empty when nothing)."""
    rows: list[list[object]] = []
    if summary.get("writers_replaced"):
        lost_with = sum("writer died" in reason for reason in summary.get("lost", []))
        held = (
            "what they held went to the replacement, except the versions listed lost below"
            if lost_with
            else "what they held went to the replacement and was written: nothing lost"
        )
        rows.append(["writers replaced", f"{summary['writers_replaced']} (a persistence writer died; {held})"])
    for reason in summary.get("lost", [])[:5]:
        rows.append(["  lost", reason])
    breach = summary.get("staleness_breach")
    if breach:
        rows.append(["STALENESS BOUND BROKEN", breach["message"]])
    elif summary.get("staleness_lag"):
        rows.append(["STALENESS BOUND PASSED", summary["staleness_lag"]["message"]])
    for error in summary.get("end_errors", []):
        rows.append(["end-of-run error", error])
    return rows


def _partial(summary: dict[str, Any]) -> str:
    """The partial versions' bytes (some ranks' slices of a layer: survivors' captures, the part of
    a version a lost group finished), which the whole versions' figure leaves out."""
    count = summary.get("partial_versions_written", 0)
    if not count:
        return ""
    return (
        f", and {human_bytes(summary['partial_bytes_written'])} in {count} partial version{'s' if count != 1 else ''} "
        "(some ranks' slices: survivors' captures, what a lost group finished)"
    )


def _protocol_cost(summary: dict[str, Any]) -> str:
    coord, step = summary["coordination_s_per_step"], summary["step_s_per_step"]
    share = coord["mean"] / step["mean"] if step["mean"] else 0.0
    return (
        f"{coord['mean'] * 1e3:.2f} ms mean, {coord['p90'] * 1e3:.2f} ms p90 "
        f"({share:.1%} of the {step['mean'] * 1e3:.0f} ms mean step)"
    )


#: What each drift probe's timed work is (:mod:`layercheck.workers.drift.clock`).
PROBE_WORK = {
    "snapshot_diff": "the diff against a copy of the weights and the next copy",
    "optimizer (foreach)": "the copies and norms beside torch's update",
    "optimizer (fused)": "the whole AdamW update, the drift counted inside it",
    "fused (in place of your AdamW)": "the whole AdamW update, run in place of yours with the drift counted inside it",
    "step_hooks": "a copy of the elements your optimizer steps before its step and the diff after",
}


#: The optimizer step a probe's measured step replaces (timed on an unmeasured step after each
#: measured one), for the probes whose timed work is the whole update.
OWN_STEP = {
    "optimizer (fused)": "torch's AdamW step",
    "fused (in place of your AdamW)": "your AdamW's own step",
}


def _probe_rows(summary: dict[str, Any]) -> list[list[object]]:
    """Which drift probe rank 0 ran, and what its own work cost (a GPU's device time); for a probe
    that runs the whole update in place of the optimizer's, what it costs beyond that step."""
    probe = summary.get("drift_probe")
    if not probe:
        return []
    step_mean = summary["step_s_per_step"]["mean"]
    work = PROBE_WORK.get(probe["probe"])
    text = (
        f"{probe['probe']}, measured at {probe['measured_steps']} of {probe['steps']} steps: "
        f"{probe['s_per_measured_step'] * 1e3:.2f} ms a measured step{f' ({work})' if work else ''}, "
    )
    per_step = probe["s_per_step"]
    if "s_per_own_step" in probe:
        per_step = probe["added_s_per_step"]
        text += (
            f"against {probe['s_per_own_step'] * 1e3:.2f} ms for {OWN_STEP.get(probe['probe'], 'the own step')} "
            f"(timed on {probe['own_steps']} unmeasured steps): {probe['added_s_per_measured_step'] * 1e3:+.2f} ms "
            f"a measured step, {per_step * 1e3:+.2f} ms a step"
        )
    else:
        text += f"{per_step * 1e3:.2f} ms a step"
    if step_mean:
        text += f" ({per_step / step_mean:.1%} of the {step_mean * 1e3:.0f} ms mean step)"
    return [["drift probe (rank 0)", text]]
