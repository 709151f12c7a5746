"""Fencing: each owner of a store writes under an epoch, and a superseded owner's late commits
are ignored by every reader, whatever the clocks or signals.

The lease (``lease.py``) keeps two live runs apart, but it cannot stop a driver that was frozen
(SIGSTOP, a long GC pause, a VM migration) past its expiry and woke up after another run took the
store over: such a driver may have passed every check and be one write away from a commit. So
every time a run takes the lease it opens an **epoch**: ``epochs/{n:010d}.json``, ``n`` one more
than the newest, never rewritten, never deleted. It names the owner and **seals** the versions of
earlier epochs: the ids of every commit record present when it was opened. Each commit record
carries the epoch it was written under, and the rule every reader applies is

    a record of epoch ``e`` counts if ``e`` is the newest epoch, or if the first epoch after
    ``e`` sealed it.

A record a superseded owner commits after the takeover is sealed by no one: it is *fenced out*,
never planned from, reported by ``layercheck verify`` and deleted by ``layercheck gc``. The
owner's own check before each commit (:class:`EpochFence`: its epoch is still the newest) stops
it writing at all in every case but a freeze between that check and the write, which the rule
covers. Stores written before epochs existed have none; their records are epoch 0 and count
until a run opens epoch 1 over them.

On local disk an epoch file is created exclusively (a hard link: two owners cannot open the
same epoch), and a start fixes the number it opens before it reads the lease, so of two starts
that both found the lease free or stale only one gets on; object stores have no exclusive create,
and the lease's own settle-and-check (``StoreLease.acquire``) with a check just before the epoch's
write is what keeps two simultaneous starts from both getting that far.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from layercheck.orchestrator.store.errors import LeaseLostError, ManifestError, StoreBusyError, StoreUnavailableError
from layercheck.orchestrator.store.fs import TMP_PATTERN, StoreFS, create_exclusive

logger = logging.getLogger(__name__)

EPOCHS_DIR = "epochs"
EPOCH_FORMAT = "layercheck.epoch/1"
_EPOCH_FILE = re.compile(r"^(\d{10})\.json$")


def epoch_path(epoch: int) -> str:
    return f"{EPOCHS_DIR}/{epoch:010d}.json"


#: An epoch file's path as :func:`epoch_path` names it, or the temporary of its exclusive create:
#: a file LayerCheck wrote (``run_dir.owned_file``).
EPOCH_FILE = re.compile(rf"^{EPOCHS_DIR}/\d{{10}}\.json({TMP_PATTERN})?$")


@dataclass(frozen=True, kw_only=True)
class Epoch:
    """One owner's term on a store."""

    epoch: int
    owner: str
    """The lease owner id that opened it."""
    run: str
    opened_at: float
    sealed: frozenset[str]
    """Version ids of the commit records present when it was opened: the earlier epochs' records
    that still count (a record of an earlier epoch missing here was written after the takeover)."""
    steps: int | None = None
    """The last step this term's run may train (``layercheck train``'s ``steps``; None: not known,
    an own loop): a record of this epoch claiming a later step is damaged."""

    def to_json(self) -> dict[str, object]:
        return {
            "format": EPOCH_FORMAT,
            "epoch": self.epoch,
            "owner": self.owner,
            "run": self.run,
            "opened_at": self.opened_at,
            "sealed": sorted(self.sealed),
            "steps": self.steps,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str) -> Epoch:
        if data.get("format") != EPOCH_FORMAT:
            raise ManifestError(f"{source}: format is {data.get('format')!r}, expected {EPOCH_FORMAT!r}")
        try:
            return cls(
                epoch=int(data["epoch"]),
                owner=str(data["owner"]),
                run=str(data["run"]),
                opened_at=float(data["opened_at"]),
                sealed=frozenset(str(v) for v in data["sealed"]),
                steps=None if data.get("steps") is None else int(data["steps"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"{source}: malformed epoch file ({error!r})") from error

    def describe(self) -> str:
        return f"epoch {self.epoch} (run {self.run!r}, opened {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.opened_at))})"


def epoch_numbers(fs: StoreFS) -> list[int]:
    """The epochs opened on the store, oldest first (one listing, nothing read)."""
    numbers = []
    for rel, _ in fs.list_files(EPOCHS_DIR):
        match = _EPOCH_FILE.match(rel[len(EPOCHS_DIR) + 1 :])
        if match:
            numbers.append(int(match.group(1)))
    return sorted(numbers)


@dataclass(frozen=True, kw_only=True)
class EpochHistory:
    """The epochs a store lists, those of them read (the ones a set of records needs), and the
    epoch files that could not be read."""

    numbers: tuple[int, ...]
    """Every epoch the store lists, oldest first."""
    epochs: dict[int, Epoch]
    """The epoch files read, by number."""
    problems: tuple[str, ...] = ()

    @property
    def newest(self) -> int:
        return self.numbers[-1] if self.numbers else 0

    def claims_unopened(self, epoch: int) -> bool:
        """A record of ``epoch`` cannot exist: no such epoch was opened (its record is damaged).
        A store without epoch files accepts any (they were deleted, or copied without them)."""
        return bool(self.numbers) and epoch > self.newest

    def beyond_its_run(self, step: int, epoch: int) -> int | None:
        """The steps of ``epoch``'s run when ``step`` is past them (a record claiming it is
        damaged: no run of that term trained so far); None if it is not, or not known."""
        limit = self.epochs[epoch].steps if epoch in self.epochs else None
        return limit if limit is not None and step > limit else None

    def fenced_out(self, version_id: str, epoch: int) -> Epoch | None:
        """The epoch that fences out record ``version_id`` of ``epoch`` (None: it counts, also when
        the epoch that follows it could not be read: then nothing proves it late)."""
        following = following_epoch(self.numbers, epoch)
        if following is None or following not in self.epochs:
            return None
        sealing = self.epochs[following]
        return None if version_id in sealing.sealed else sealing


def following_epoch(numbers: Sequence[int], epoch: int) -> int | None:
    """The first of ``numbers`` after ``epoch`` (the one whose seal decides its records)."""
    return next((n for n in numbers if n > epoch), None)


def read_epochs(fs: StoreFS, *, record_epochs: Collection[int] | None = None) -> EpochHistory:
    """The store's epochs: every one listed, and the files that records of ``record_epochs`` need
    read (each such epoch's own, for its run's steps, and the one after it, whose seal decides
    them; ``None``: every file). An unreadable one is a problem (``verify`` reports it) and is left
    out: the records it would have fenced out then count, as they would on a store without epochs."""
    numbers = tuple(epoch_numbers(fs))
    if record_epochs is None:
        wanted = set(numbers)
    else:
        wanted = {e for e in record_epochs if e in numbers}
        wanted |= {f for e in record_epochs if (f := following_epoch(numbers, e)) is not None}
    epochs, problems = {}, []
    for number in sorted(wanted):
        rel = epoch_path(number)
        try:
            epoch = Epoch.from_json(json.loads(fs.read_bytes(rel)), source=fs.uri(rel))
        except FileNotFoundError:
            continue
        except StoreUnavailableError:
            raise  # not an answer about the file: its records are neither fenced nor damaged by it
        except (OSError, ValueError) as error:
            problems.append(f"{fs.uri(rel)}: unreadable epoch file ({error})")
            continue
        if epoch.epoch != number:
            problems.append(f"{fs.uri(rel)}: names epoch {epoch.epoch}, not its file name")
            continue
        epochs[number] = epoch
    return EpochHistory(numbers=numbers, epochs=epochs, problems=tuple(problems))


def next_epoch(fs: StoreFS) -> int:
    """The number the next epoch opened on the store gets (one listing)."""
    numbers = epoch_numbers(fs)
    return (numbers[-1] if numbers else 0) + 1


def refuse_if_opened(fs: StoreFS, epoch: int) -> None:
    """Raise :class:`StoreBusyError` naming its owner if ``epoch`` has been opened already."""
    if fs.info(epoch_path(epoch)).type != pafs.FileType.NotFound:
        raise _taken_meanwhile(fs, epoch)


def _taken_meanwhile(fs: StoreFS, epoch: int) -> StoreBusyError:
    try:
        opened = Epoch.from_json(json.loads(fs.read_bytes(epoch_path(epoch))), source="").describe()
    except (OSError, ValueError):
        opened = f"epoch {epoch}"
    return StoreBusyError(
        f"{fs.uri()} was taken at the same moment by another run, which opened {opened} first. Two runs "
        "must not write one store: let it finish, or stop it."
    )


def open_epoch(
    fs: StoreFS, *, epoch: int, owner: str, run: str, sealed: frozenset[str], steps: int | None = None
) -> Epoch:
    """Open epoch ``epoch`` (:func:`next_epoch`, listed before the lease it comes with was read)
    for ``owner``, sealing the records ``sealed``; ``steps``: the last step its run may train, if
    known. Raises :class:`StoreBusyError` naming its owner if another start opened it first.

    The number is fixed before the lease is read, not listed again here: two starts that both
    found the lease free or stale then aim at the same epoch, and only one can open it (an
    exclusive create on local disk; on object stores, which have none, a check just before the
    write narrows the race to the moment between the two). Listed again, the later one would
    open the next epoch and go on beside the first until the fence stopped that one."""
    opened = Epoch(epoch=epoch, owner=owner, run=run, opened_at=time.time(), sealed=sealed, steps=steps)
    data = json.dumps(opened.to_json(), indent=1).encode()
    rel = epoch_path(epoch)
    if fs.fs.type_name == "local":
        try:
            create_exclusive(fs, rel, data, what="the run's epoch")
        except FileExistsError:
            raise _taken_meanwhile(fs, epoch) from None
    else:
        refuse_if_opened(fs, epoch)
        fs.write_bytes(rel, data)
    logger.info("opened epoch %d on %s (%d earlier version(s) sealed)", epoch, fs.uri(), len(sealed))
    return opened


@dataclass(frozen=True)
class EpochFence:
    """The check a run's commits pass first: its epoch is still the store's newest. A run frozen
    past its lease and taken over finds out at its next commit (and if it froze between this
    check and the write, readers fence the record out: see the module's rule)."""

    fs: StoreFS
    epoch: int

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless ``epoch`` is still the store's newest."""
        numbers = epoch_numbers(self.fs)
        newest = numbers[-1] if numbers else 0
        if newest != self.epoch:
            raise LeaseLostError(
                f"this run no longer holds {self.fs.uri()}: it wrote under epoch {self.epoch}, and "
                f"{_taker(self.fs, newest)} took the store over; nothing more is committed"
            )


def _taker(fs: StoreFS, newest: int) -> str:
    """Who opened epoch ``newest``, for a message."""
    try:
        return f"another run, {Epoch.from_json(json.loads(fs.read_bytes(epoch_path(newest))), source='').describe()},"
    except (OSError, ValueError):
        return f"another run (epoch {newest})"
