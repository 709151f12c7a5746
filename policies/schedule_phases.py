"""Phase assignment for periodic per-layer saves: spread the layers over the steps so every step
hands over about the same number of bytes.

A layer saved every ``period`` steps from step ``due`` loads the steps ``due, due + period, …``.
:func:`place` gives new layers their first step, largest first, each where the heaviest step it
would land on is lightest — with equal periods this is exactly LPT ("largest first into the
least-loaded slot") over the ``period`` slots, whose peak is at most ``4/3`` of the best possible
(Graham 1969) and at most ``total/period`` plus the layer that tops the peak slot.

Where fewer layers than steps share a period, many steps tie at nothing handed over. A tie goes
to the earliest step, so the layers' first saves come on consecutive steps (every layer has a
version soon after the warm-up, all of about the same age), or, for an item placed ``spread``, to
the step with the most room around it (:func:`room`), so the saves come evenly over the period:
storage that writes just the schedule's bytes per step then holds about one layer in flight,
where saves on consecutive steps leave most of a checkpoint waiting once a period (host memory,
and past ``persistence.max_inflight_bytes`` the ranks' wait). Everything here is plain numbers:
no state, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Longest look-ahead (steps) of a load table: placement costs O(horizon) per layer.
MAX_HORIZON = 20_000


@dataclass(frozen=True, kw_only=True)
class Recurring:
    """One layer's saves: ``size`` bytes at ``due`` and every ``period`` steps after it
    (``period=None``: once, at ``due``)."""

    size: int
    due: int
    period: int | None


@dataclass(frozen=True, kw_only=True)
class Item:
    """A layer to place: ``size`` bytes every ``period`` steps (``None``: a one-off save), its
    first save somewhere in the ``window`` steps from ``offset`` steps after the table's start."""

    name: str
    size: int
    period: int | None
    window: int
    offset: int = 0
    """Its first save no earlier than this many steps after the table's start."""
    spread: bool = False
    """Ties go to the offset with the most room around it (saves evenly over the period), not to
    the earliest."""


def horizon_for(periods: Sequence[int | None], window: int = 1) -> int:
    """A look-ahead that sees every recurring layer at least twice (so a placement sees what it
    collides with in the steady state), capped at :data:`MAX_HORIZON`."""
    longest = max([window, *(p for p in periods if p is not None)])
    return max(1, min(2 * longest, MAX_HORIZON))


def load_table(saves: Mapping[str, Recurring], *, start: int, horizon: int) -> list[int]:
    """Bytes handed over at each of the steps ``start … start + horizon - 1``."""
    load = [0] * horizon
    for save in saves.values():
        first = save.due - start
        if save.period is None:
            if 0 <= first < horizon:
                load[first] += save.size
            continue
        if first < 0:  # overdue or behind: its next occurrence in the table
            first %= save.period
        for i in range(first, horizon, save.period):
            load[i] += save.size
    return load


def place(items: Sequence[Item], load: list[int], *, start: int) -> dict[str, int]:
    """First save step of each item, largest first; adds them to ``load`` (mutated).

    An item goes to the offset in ``[offset, offset + window)`` whose heaviest occurrence in the table is
    lightest; ties go to the lightest first occurrence, then (an item placed ``spread``) to the
    offset with the most room around it (:func:`room`), then to the earliest (deterministic: the
    same layers and sizes always get the same phases)."""
    horizon = len(load)
    order = sorted(range(len(items)), key=lambda i: (-items[i].size, i))
    rate = _plan_rate(items, load) if any(item.spread for item in items) else 0.0
    dues: dict[str, int] = {}
    for i in order:
        item = items[i]
        first = min(item.offset, horizon - 1)
        candidates = range(first, max(first + 1, min(first + item.window, horizon)))
        step = item.period if item.period is not None else horizon
        if item.spread:
            free = room(load, item.size, rate)
            best = min(candidates, key=lambda o: (max(load[o::step]), load[o], -min(free[o::step]), o))
        else:
            best = min(candidates, key=lambda o: (max(load[o::step]), load[o], o))
        for j in range(best, horizon, step):
            load[j] += item.size
        dues[item.name] = start + best
    return dues


def _plan_rate(items: Sequence[Item], load: Sequence[int]) -> float:
    """The bytes per step storage takes for the whole plan (the table's saves and the items'),
    the unit :func:`room` counts a save's time in."""
    horizon = len(load)
    if not horizon:
        return 0.0
    return (sum(load) + sum(i.size * horizon / (i.period or horizon) for i in items)) / horizon


def room(load: Sequence[int], size: int, rate: float) -> list[float]:
    """Per step of the table, the steps of slack a save of ``size`` bytes there would have where
    storage writes ``rate`` bytes per step. Each save alone keeps storage busy for ``bytes / rate``
    steps from its step (saves that overlap are not queued behind each other: a heuristic); the
    slack is the lesser of the time since the latest such write before the step ended and the
    time from this save's own write's end to the next save (negative: they overlap). A loaded
    step has no slack. Two passes: O(steps)."""
    horizon = len(load)
    if rate <= 0:
        return [0.0] * horizon
    out = [float(horizon)] * horizon
    busy_until = None  # when the latest write of the saves before each step ends
    for i in range(horizon):
        if busy_until is not None:
            out[i] = i - busy_until
        if load[i] > 0:
            busy_until = max(busy_until or 0.0, i + load[i] / rate)
    following = None  # the next loaded step after each one
    for i in reversed(range(horizon)):
        if following is not None:
            out[i] = min(out[i], following - i - size / rate)
        if load[i] > 0:
            following = i
    return [min(v, -1.0) if load[i] > 0 else v for i, v in enumerate(out)]


def lpt_phases(sizes: Mapping[str, int], period: int, *, spread: bool = False) -> dict[str, int]:
    """Offsets in ``[0, period)`` of layers all saved every ``period`` steps: LPT over the slots
    (over two periods of steps, so a save late in one sees the next period's first)."""
    load = [0] * horizon_for([period])
    items = [Item(name=name, size=size, period=period, window=period, spread=spread) for name, size in sizes.items()]
    return place(items, load, start=0)
