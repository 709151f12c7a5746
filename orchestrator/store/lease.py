"""One owner per store: a lease file, so that two ``layercheck train`` of one run never write
into the same store.

``owner.json`` in the run's root names the owner (a random id, host, pid, run name) and when
its lease expires. The driver takes the lease before it writes anything, renews it while the
run lives (:meth:`StoreLease.keep_alive`) and deletes it at the end. A second run finds a live
lease and is refused with the owner named. A lease is *stale*, and may be taken over, when it
has expired (its driver stopped renewing: crashed, killed, or its host is gone) or when its
process is gone from this very host. ``take_over=True`` takes any lease (the operator knows the
owner is dead).

Taking the lease opens the store's next *epoch* (``epochs.py``): the fence that keeps a driver
frozen past its expiry (SIGSTOP) from mixing its late commits with the new owner's, whatever the
clocks. Whether this process still owns the store is decided by the epoch, not by
``owner.json``: a superseded driver's renewal that lands over the new owner's lease is written
back by the new owner's next renewal.

Works on any pyarrow filesystem. Publishing a new lease is exclusive on local disk (a hard link
of a complete temporary file, which fails if the lease exists); on object stores, which have no
exclusive create, the lease is written and read back after a short settle time, and the loser
of a simultaneous start sees the other's id and backs off. Expiry compares wall clocks of
different hosts: the TTL must be much longer than their skew (minutes against NTP's
milliseconds).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from layercheck.orchestrator.store.epochs import (
    Epoch,
    EpochFence,
    epoch_numbers,
    next_epoch,
    open_epoch,
    refuse_if_opened,
)
from layercheck.orchestrator.store.errors import LeaseLostError, StoreBusyError
from layercheck.orchestrator.store.fs import StoreFS, create_exclusive
from layercheck.orchestrator.store.lease_term import LEASE_LAPSED
from layercheck.orchestrator.store.manifest import listed_version_ids

logger = logging.getLogger(__name__)

LEASE_FILE = "owner.json"
LEASE_FORMAT = "layercheck.lease/1"
#: Seconds a lease lives unless renewed; the driver renews it every third of that.
DEFAULT_TTL_S = 120.0


@dataclass(frozen=True, kw_only=True)
class LeaseInfo:
    """The content of the lease file."""

    owner: str
    host: str
    pid: int
    run: str
    acquired_at: float
    expires_at: float

    def to_json(self) -> dict[str, object]:
        return {"format": LEASE_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LeaseInfo:
        if data.get("format") != LEASE_FORMAT:
            raise ValueError(f"not a LayerCheck lease (format {data.get('format')!r})")
        return cls(
            owner=str(data["owner"]),
            host=str(data["host"]),
            pid=int(data["pid"]),
            run=str(data["run"]),
            acquired_at=float(data["acquired_at"]),
            expires_at=float(data["expires_at"]),
        )

    def describe(self) -> str:
        return (
            f"run {self.run!r} (pid {self.pid} on {self.host}, since {_clock(self.acquired_at)}, "
            f"lease valid until {_clock(self.expires_at)})"
        )


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def stale_reason(info: LeaseInfo, *, now: float, host: str, pid: int) -> str:
    """Why ``info`` may be taken over by process ``pid`` on ``host`` at ``now`` ("" if it is live)."""
    if info.expires_at <= now:
        return f"its lease expired at {_clock(info.expires_at)}"
    if info.host == host and (info.pid == pid or not _pid_alive(info.pid)):
        return f"its process {info.pid} on this host is gone" if info.pid != pid else "it is this process's own"
    return ""


def read_lease(fs: StoreFS) -> LeaseInfo | None:
    """The lease in ``fs`` (None: there is none). An unreadable lease file counts as none, with
    a warning: it cannot name a live owner."""
    try:
        data = json.loads(fs.read_bytes(LEASE_FILE))
        return LeaseInfo.from_json(data)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring the unreadable lease %s: %s", fs.uri(LEASE_FILE), error)
        return None


#: How a run stopped for a lost lease says so (its stop reason starts with this).
LEASE_LOST = "the store's lease was lost"


def stopped_for_the_lease(stop_reason: str | None) -> bool:
    """Whether a run stopped because its store may be another run's now: its lease was found
    taken (:data:`LEASE_LOST`) or lapsed unrenewed (``lease_term.LEASE_LAPSED``)."""
    return str(stop_reason or "").startswith((LEASE_LOST, LEASE_LAPSED))


def _publish(fs: StoreFS, info: LeaseInfo, *, exclusive: bool, settle_s: float) -> None:
    data = json.dumps(info.to_json(), indent=1).encode()
    if exclusive and fs.fs.type_name == "local":
        try:
            create_exclusive(fs, LEASE_FILE, data, what="the run's lease")
        except FileExistsError:
            other = read_lease(fs)
            raise StoreBusyError(
                f"{fs.uri()} was taken at the same moment by {other.describe() if other else 'another run'}"
            ) from None
        return
    fs.write_bytes(LEASE_FILE, data)
    if not fs.atomic_rename:  # an object store: a simultaneous writer's PUT may land after ours
        time.sleep(settle_s)
    current = read_lease(fs)
    if current is None or current.owner != info.owner:
        raise StoreBusyError(
            f"taking the lease on {fs.uri()} failed: it now belongs to "
            f"{current.describe() if current else 'nobody (it was deleted)'}"
        )


class StoreLease:
    """This process's lease on a store. Get one with :meth:`acquire`."""

    def __init__(self, fs: StoreFS, info: LeaseInfo, ttl_s: float, epoch: Epoch) -> None:
        self.fs = fs
        self.info = info
        self.ttl_s = ttl_s
        self.epoch = epoch
        """The epoch this lease opened: every commit record of the run carries its number."""
        self.lost = False
        """Set when a renewal found another owner's lease: this process no longer owns the store."""
        self.on_lost: Callable[[str], None] | None = None
        """Called (from the renewal thread) with the reason once the lease is found lost: the
        driver stops the run."""
        self.on_renewed: Callable[[float], None] | None = None
        """Called (from the renewal thread) with :attr:`valid_until` after each renewal that reached
        the store: the driver hands it to whoever writes and commits (``lease_term.LeaseTerm``)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(
        cls,
        fs: StoreFS,
        *,
        run: str,
        ttl_s: float = DEFAULT_TTL_S,
        take_over: bool = False,
        settle_s: float = 1.0,
        steps: int | None = None,
    ) -> StoreLease:
        """Take the store's lease and open its next epoch, sealing the versions committed so far
        (``steps``: the last step the run may train, if known); or raise :class:`StoreBusyError`
        naming its live owner."""
        host, pid, now = socket.gethostname(), os.getpid(), time.time()
        # the epoch this start opens is fixed before the lease is read: two starts that both find
        # it free or stale (two --resume after a killed driver) then aim at one epoch, which only
        # one of them can open; the other is refused, not let on beside it until the fence
        epoch_number = next_epoch(fs)
        current = read_lease(fs)
        if current is not None:
            reason = "--take-over" if take_over else stale_reason(current, now=now, host=host, pid=pid)
            if not reason:
                raise StoreBusyError(
                    f"{fs.uri()} is in use by {current.describe()}. Two runs must not write one store: let it "
                    "finish, or stop it. If it is gone (its host died), wait until the lease expires, or pass "
                    "--take-over to take the store now."
                )
            logger.warning("taking over %s from %s: %s", fs.uri(), current.describe(), reason)
        info = LeaseInfo(
            owner=secrets.token_hex(8), host=host, pid=pid, run=run, acquired_at=now, expires_at=now + ttl_s
        )
        refuse_if_opened(fs, epoch_number)  # a start that got there first keeps its lease file
        _publish(fs, info, exclusive=current is None, settle_s=settle_s)
        # sealed: the ids of the records committed so far (a listing, nothing read); a frozen
        # previous owner's commit from now on is sealed by no epoch and never counts
        epoch = open_epoch(
            fs, epoch=epoch_number, owner=info.owner, run=run, sealed=listed_version_ids(fs), steps=steps
        )
        logger.info("took the lease on %s (owner %s, epoch %d)", fs.uri(), info.owner, epoch.epoch)
        return cls(fs, info, ttl_s, epoch)

    @property
    def valid_until(self) -> float:
        """When the lease expires (wall clock), as the last write of it that succeeded says: what
        another run sees, so this run may write to the store until then and no longer."""
        return self.info.expires_at

    @property
    def fence(self) -> EpochFence:
        """The check that keeps this run's commits out once another run has opened a newer epoch."""
        return EpochFence(self.fs, self.epoch.epoch)

    def _check_still_ours(self) -> None:
        numbers = epoch_numbers(self.fs)
        if not numbers or numbers[-1] != self.epoch.epoch:
            self.lost = True
            current = read_lease(self.fs)
            raise LeaseLostError(
                f"the lease on {self.fs.uri()} is lost: it now belongs to "
                f"{current.describe() if current else 'nobody (it was deleted)'}, under epoch "
                f"{numbers[-1] if numbers else '(none)'} (this run's was {self.epoch.epoch})"
            )
        current = read_lease(self.fs)
        if current is not None and current.owner != self.info.owner:
            logger.warning(
                "the lease on %s was overwritten by %s, whose epoch is over (a frozen driver's late renewal): "
                "writing it back",
                self.fs.uri(),
                current.describe(),
            )

    def renew(self) -> None:
        """Extend the lease by its TTL, counted from before the store is asked anything (the store
        may take long to answer); :class:`LeaseLostError` (and ``lost``) if another run has opened a
        newer epoch. :attr:`valid_until` moves only once the new expiry is written: a renewal that
        fails leaves it where the store has it."""
        renewed = LeaseInfo(**{**asdict(self.info), "expires_at": time.time() + self.ttl_s})
        self._check_still_ours()
        self.fs.write_bytes(LEASE_FILE, json.dumps(renewed.to_json(), indent=1).encode())
        self.info = renewed
        if self.on_renewed is not None:
            self.on_renewed(renewed.expires_at)

    def keep_alive(self) -> None:
        """Renew the lease from a daemon thread every third of its TTL until :meth:`release`."""
        self._thread = threading.Thread(target=self._renew_loop, name="layercheck-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        # every third of the TTL from the start of the previous try, not from its end: a renewal on
        # storage that does not answer takes the store's timeouts (each request's, times its
        # retries) before it fails, and waiting a whole period after that would leave no second try
        # before the expiry
        period = self.ttl_s / 3
        began = time.monotonic()
        while not self._stop.wait(max(0.0, began + period - time.monotonic())):
            began = time.monotonic()
            try:
                self.renew()
            except StoreBusyError as error:
                logger.error("%s; this run no longer owns its store and must stop writing", error)
                if self.on_lost is not None:
                    self.on_lost(str(error))
                return
            except Exception as error:  # noqa: BLE001 - storage trouble: try again next period; the thread must not die
                logger.warning(
                    "could not renew the lease on %s (it stays valid until %s): %s",
                    self.fs.uri(),
                    _clock(self.valid_until),
                    error,
                )

    def release(self, *, wait_s: float | None = None) -> None:
        """Stop renewing and delete the lease, if it is still ours. ``wait_s``: how long to wait for
        a renewal under way (``None``: until it ends); if it has not ended by then (storage that
        does not answer), the lease is left to expire by itself: deleted now, it would be written
        again by that renewal should it land later."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)
            if self._thread.is_alive():
                logger.warning(
                    "a renewal of the lease on %s did not end within %gs: leaving the lease to expire by itself at %s",
                    self.fs.uri(),
                    wait_s,
                    _clock(self.valid_until),
                )
                return
        try:
            current = read_lease(self.fs)
            if current is not None and current.owner == self.info.owner:
                self.fs.delete(LEASE_FILE)
                logger.info("released the lease on %s", self.fs.uri())
        except OSError as error:
            logger.warning("could not release the lease on %s (it expires by itself): %s", self.fs.uri(), error)
