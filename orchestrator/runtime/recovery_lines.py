"""How the closing summary of a run (:mod:`layercheck.orchestrator.runtime.run_summary`) tells its
recoveries: for each, where it went (in place or a full restart, and why), its time from the
failure to the next step and where that went, the elements it brought back and from where; then
the survivors' captures, the warm spares and the recovered elements over all recoveries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from layercheck.orchestrator.core.accounting import FALLBACK_REASONS, format_sources
from layercheck.orchestrator.core.memory.auto_period import MemoryPeriod
from layercheck.orchestrator.table import human_bytes
from layercheck.policies.layer_map import describe_layers


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
            period = period_at_failure(summary, r)
            stale = _stale_elements(r, hint=not period)
            if stale:
                rows.append(["    not as at the failure", stale])
            check = period_check(r, period)
            if check is not None:
                rows.append(_period_row(check))
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


def period_at_failure(summary: dict[str, Any], recovery: dict[str, Any]) -> int:
    """The memory versions' period in force at ``recovery``'s ``t_fail`` (``"auto"``: 1 until the
    run chose its period, then that one)."""
    choice = summary.get("memory_period_choice")
    if choice:
        return MemoryPeriod.from_json(choice).at(recovery["t_fail"])
    return int(summary.get("memory_period", 0))


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


def _stale_elements(r: dict[str, Any], *, hint: bool = True) -> str:
    """The price of no rollback in a recovery: the elements it brought back from a step before
    ``t_fail`` (a lost rank's stored versions), how stale, and (``hint``) the knob that bounds it
    ("" if none)."""
    if not recovered(r):
        return ""
    sources = [s for layer in r["sources"].values() for s in layer if s["elements"]]
    stale = [(s["elements"], r["t_fail"] - s["step"]) for s in sources if s["step"] < r["t_fail"]]
    count, total = sum(n for n, _ in stale), sum(s["elements"] for s in sources)
    if not count:
        return ""
    mean = sum(n * age for n, age in stale) / count
    text = (
        f"{count:,} of {total:,} elements ({count / total:.0%}) came back {mean:.1f} steps stale on average "
        f"(at most {max(age for _, age in stale)}): the steps a rollback would have re-run for them"
    )
    if not hint:
        return text
    return (
        f"{text}. persistence.memory_period = P brings a lost rank's slices back at most P steps stale, from the "
        "writers' memory"
    )


@dataclass(frozen=True, kw_only=True)
class PeriodCheck:
    """Whether a recovery kept ``persistence.memory_period``'s promise, judged from what it loaded
    (its ``sources``): every element back at most ``period`` steps stale."""

    period: int
    t_fail: int
    elements: int
    """Every element the recovery brought back."""
    late_elements: int
    """Of them, those more than ``period`` steps stale."""
    mean_staleness: float
    """Of ``late_elements``, the mean steps stale (0 when none)."""
    max_staleness: int
    late_layers: tuple[str, ...]
    """The layers some of whose elements came back late."""

    @property
    def kept(self) -> bool:
        return not self.late_elements

    def to_json(self) -> dict[str, object]:
        return {
            "t_fail": self.t_fail,
            "period": self.period,
            "kept": self.kept,
            "elements": self.elements,
            "late_elements": self.late_elements,
            "mean_staleness": self.mean_staleness,
            "max_staleness": self.max_staleness,
            "late_layers": list(self.late_layers),
        }


def period_check(recovery: dict[str, Any], period: int) -> PeriodCheck | None:
    """``recovery`` against ``persistence.memory_period = period``: ``None`` with no memory
    versions, for a ``--resume`` (it promised nothing), a recovery that loaded nothing, or one the
    next failure overtook (the run continued from the next one's composite). A memory
    version is taken every ``period`` steps and may be lost with the rank mid-step, so an element
    from ``t_fail - period`` still keeps the promise; one older came from a version the writers did
    not hold a fresher one of (a budget short of a whole memory version, a writer lost with it)."""
    if not period or not recovered(recovery) or not recovery.get("sources") or recovery.get("interrupted"):
        return None
    t_fail, elements, late, layers = recovery["t_fail"], 0, [], []
    for layer, sources in recovery["sources"].items():
        for source in sources:
            elements += source["elements"]
            age = t_fail - source["step"]
            if source["elements"] and age > period:
                late.append((source["elements"], age))
                layers.append(layer)
    count = sum(n for n, _ in late)
    return PeriodCheck(
        period=period,
        t_fail=t_fail,
        elements=elements,
        late_elements=count,
        mean_staleness=sum(n * age for n, age in late) / count if count else 0.0,
        max_staleness=max((age for _, age in late), default=0),
        late_layers=tuple(dict.fromkeys(layers)),
    )


def _period_row(check: PeriodCheck) -> list[object]:
    steps = f"{check.period} step{'s' if check.period != 1 else ''}"
    if check.kept:
        return ["    memory_period kept", f"every element came back at most {steps} stale"]
    return [
        "    MEMORY_PERIOD NOT KEPT",
        f"{check.late_elements:,} of {check.elements:,} elements ({check.late_elements / check.elements:.0%}) "
        f"came back more than {steps} stale ({check.mean_staleness:.1f} on average, at most {check.max_staleness}), "
        f"from older versions of {describe_layers(list(check.late_layers))}: the writers held no memory version of "
        "them (persistence.memory_bytes short of a whole one, said at the start; or a writer lost with it)",
    ]


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
