"""How the closing summary of a run (:mod:`layercheck.orchestrator.runtime.run_summary`) tells its
recoveries: for each, where it went (in place or a full restart, and why), its time from the
failure to the next step and where that went, the elements it brought back and from where; then
the survivors' captures, the warm spares and the recovered elements over all recoveries."""

from __future__ import annotations

from typing import Any

from layercheck.orchestrator.core.accounting import FALLBACK_REASONS, format_sources
from layercheck.orchestrator.table import human_bytes


def recovery_rows(summary: dict[str, Any]) -> list[list[object]]:
    """The summary's rows for its recoveries (none for a run without one)."""
    rows: list[list[object]] = []
    for r in summary["recoveries"]:
        rows.append(
            [
                f"  {_recovery_kind(r)} after step {r['t_fail']}",
                f"resumed at {r['resumed_at']}; {_recovery_time(r)}; composite staleness max {r['max_staleness']}, "
                f"weighted {r['weighted_staleness']:.1f}; steps redone {r['steps_redone']}",
            ]
        )
        if r.get("sources"):
            rows.append(["    elements from", format_sources(r["sources"])])
            stale = _stale_elements(r)
            if stale:
                rows.append(["    not as at the failure", stale])
        if "storage_shards" in r:
            rows.append(["    composite loaded from", _load_sources(r)])
    rows += _capture_rows(summary)
    if summary.get("spares"):
        rows.append(_spares_row(summary["spares"]))
    elements = summary.get("recovered_elements", {})
    if summary["recoveries"] and (elements.get("capture") or elements.get("initial") or elements.get("memory")):
        parts = [f"{elements.get('capture', 0):,} from survivors' captures"]
        if elements.get("memory"):
            parts.append(f"{elements['memory']:,} from memory versions (persistence.memory_period)")
        parts.append(f"{elements.get('stored', 0):,} stored")
        if elements.get("initial"):
            parts.append(f"{elements['initial']:,} from the initial state (not saved yet)")
        rows.append(["recovered elements", ", ".join(parts)])
    return rows


def recovered(recovery: dict[str, Any]) -> bool:
    """A recovery from a failure (not a ``--resume``)."""
    return recovery.get("kind", "failure") != "resume"


def _recovery_kind(recovery: dict[str, Any]) -> str:
    """A grown elastic group is a restart LayerCheck resumes like a recovery, not a failure; a
    ``--resume`` continues a stopped run."""
    if recovery.get("grown_from"):
        return f"group grown {recovery['grown_from']} -> {recovery['world_size']} workers"
    if recovery.get("kind") == "resume":
        return "--resume from the store"
    return "recovery"


def _recovery_time(r: dict[str, Any]) -> str:
    """A recovery's time from the failure to its first step, and where it went."""
    t = r.get("timeline") or {}
    path, kept = r.get("path", "full restart"), r.get("kept_processes", 0)
    promoted = r.get("spares_promoted", 0)
    refused = r.get("refused") or {}  # a rank that raised out of its train function, and why
    # the failure itself: a rank's own step raised (said even where the recovery was cut short)
    own_step = (
        f"replaced a rank whose own step failed: {refused['detail']}" if refused.get("reason") == "rank_failed" else ""
    )
    if r.get("interrupted"):  # before any of its ranks loaded, often: no path to tell
        path = "interrupted by the next failure before its first step" + (f" ({own_step})" if own_step else "")
    elif kept or promoted:
        how = [f"{kept} rank{'s' if kept != 1 else ''} kept {'their' if kept != 1 else 'its'} process"] if kept else []
        how += [f"{promoted} spare{'s' if promoted != 1 else ''} promoted"] if promoted else []
        if own_step:
            how += [own_step]
        elif refused.get("detail"):  # a survivor that raised on the way was replaced like a lost rank
            how += [f"a survivor left, replaced too: {refused['detail']}"]
        path += f" ({', '.join(how)})"
    elif r.get("fallback"):
        why = FALLBACK_REASONS.get(r["fallback"], r["fallback"])
        path += f" (not in place: {why}{'; ' + refused['detail'] if refused.get('detail') else ''})"
    group = f"process group {t['group']:.2f}s, " if t.get("group") else ""
    parts = (
        f"{path}: restart {t.get('restart', r['detect_restart_s']):.1f}s, process start {t.get('start', 0.0):.1f}s, "
        f"{group}engine build {t.get('build', 0.0):.1f}s, plan {r['plan_s']:.2f}s (during the build), "
        f"load {r['load_s']:.2f}s"
    )
    if r.get("failure_to_step_s") is None:
        return parts if r.get("interrupted") else f"{parts}; no step after it yet"
    return f"{r['failure_to_step_s']:.1f}s from the failure to the next step, {parts}, first step {t.get('first_step', 0.0):.2f}s"


def _stale_elements(r: dict[str, Any]) -> str:
    """The price of no rollback in a recovery: the elements it brought back from a step before
    ``t_fail`` (a lost rank's stored versions), how stale, and the knob that bounds it ("" if none)."""
    if not recovered(r):
        return ""
    sources = [s for layer in r["sources"].values() for s in layer if s["elements"]]
    stale = [(s["elements"], r["t_fail"] - s["step"]) for s in sources if s["step"] < r["t_fail"]]
    count, total = sum(n for n, _ in stale), sum(s["elements"] for s in sources)
    if not count:
        return ""
    mean = sum(n * age for n, age in stale) / count
    return (
        f"{count:,} of {total:,} elements ({count / total:.0%}) came back {mean:.1f} steps stale on average "
        f"(at most {max(age for _, age in stale)}): the steps a rollback would have re-run for them. "
        "persistence.memory_period = P brings a lost rank's slices back at most P steps stale, from the "
        "writers' memory"
    )


def _load_sources(recovery: dict[str, Any]) -> str:
    """Where a recovery's shard files came from (all ranks together)."""
    parts = [
        f"{what} {recovery[f'{key}_shards']} files / {human_bytes(recovery[f'{key}_bytes'])}"
        for key, what in (
            ("memory_local", "memory on the rank's node"),
            ("memory_remote", "memory on another node"),
            ("storage", "storage"),
        )
    ]
    rejected = recovery.get("memory_rejected", 0)
    return "; ".join(parts) + (f" ({rejected} copies in memory failed their checksum)" if rejected else "")


def _capture_rows(summary: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for c in summary.get("capture", []):
        missed = f"; missed ranks {c['missed']}" if c["missed"] else ""
        recovery = recovery_of_capture(summary.get("recoveries", []), c["attempt"])
        t_fail = recovery["t_fail"] if recovery is not None else None
        if t_fail is not None and any(step > t_fail for step in c["steps"]):
            # the survivor had finished its local update of t_fail + 1: re-training it would apply it twice
            missed += f"; a capture past t_fail {t_fail} is not used"
        window = "" if c["window_s"] is None else f"; teardown began {c['window_s']:.2f}s after the step raised"
        rows.append(
            [
                f"  survivors' capture (group {c['attempt']})",
                f"ranks {c['captured']} at step {', '.join(map(str, c['steps'])) or '-'}: "
                f"{human_bytes(c['bytes'])} in {c['capture_s']:.2f}s{window}, held {c['hold_s']:.2f}s{missed}",
            ]
        )
    return rows


def recovery_of_capture(recoveries: list[dict[str, Any]], attempt: int) -> dict[str, Any] | None:
    """The recovery a capture of worker group ``attempt`` served: the first that resumed under a
    later attempt. Not ``recoveries[attempt - 1]``: a grow (a recovery without a failure) or a
    group lost during a recovery (attempts skipped) shifts the list against the attempts. A
    recovery without its attempt (0: a summary from before it was recorded) matches none."""
    later = [r for r in recoveries if r.get("attempt", 0) > attempt]
    return min(later, key=lambda r: r["attempt"], default=None)


def _spares_row(spares: dict[str, Any]) -> list[object]:
    held = f"{spares['gpus_per_worker']} GPU" if spares["gpus_per_worker"] else f"{spares['cpus_per_worker']:g} CPU"
    count = spares["spares"]
    return [
        "warm spares",
        f"{count} worker{'s' if count != 1 else ''} held idle beside the {spares['training_workers']} training "
        f"({held} each, {count / spares['training_workers']:.0%} more workers: cluster.spares); "
        f"promoted {spares['promotions']} time{'s' if spares['promotions'] != 1 else ''}",
    ]
