"""A store has one owner at a time: a lease file, refused while live, taken
over when stale, released at the end."""

import json
import os
import subprocess
import sys
import time

import pytest

from layercheck.orchestrator.store.errors import StoreBusyError
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.lease import LEASE_FILE, LeaseInfo, StoreLease, read_lease, stale_reason
from tests.support.store_helpers import foreign_lease


def test_a_live_lease_refuses_a_second_owner_naming_the_first(tmp_path):
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    foreign_lease(fs)
    with pytest.raises(StoreBusyError) as error:
        StoreLease.acquire(fs, run="mine")
    message = str(error.value)
    assert "run 'other'" in message and "pid 4242 on other-host" in message and "--take-over" in message
    assert read_lease(fs).owner == "f00d"


def test_an_expired_lease_is_taken_over(tmp_path):
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    foreign_lease(fs, expires_in=-1)
    lease = StoreLease.acquire(fs, run="mine", settle_s=0)
    assert read_lease(fs).owner == lease.info.owner and read_lease(fs).run == "mine"
    lease.release()
    assert read_lease(fs) is None and not (tmp_path / "run" / LEASE_FILE).exists()


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    foreign_lease(fs, host=socket.gethostname(), pid=dead.pid)
    lease = StoreLease.acquire(fs, run="mine", settle_s=0)
    assert read_lease(fs).owner == lease.info.owner


def test_take_over_takes_a_live_lease(tmp_path):
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    foreign_lease(fs)
    lease = StoreLease.acquire(fs, run="mine", take_over=True, settle_s=0)
    assert read_lease(fs).owner == lease.info.owner


def test_a_lease_valid_until_2100_is_refused_naming_its_expiry_and_take_over_takes_it(tmp_path):
    """An ``owner.json`` whose expiry lies in 2100 (written by hand, or by a host whose clock ran far
    ahead) names a live owner on another host: a start is refused naming it, its expiry and how
    to take the store, and waiting would not help, so ``--take-over`` is the way: it takes the
    store under a new epoch with a lease of its own TTL. On this host, a lease whose process is
    gone is stale whatever its expiry."""
    import socket

    from layercheck.orchestrator.store.lease import DEFAULT_TTL_S

    in_2100 = time.mktime((2100, 1, 1, 0, 0, 0, 0, 0, -1))
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    foreign_lease(fs, expires_in=in_2100 - time.time())
    with pytest.raises(StoreBusyError) as refused:
        StoreLease.acquire(fs, run="mine", settle_s=0)
    assert "run 'other'" in str(refused.value) and "lease valid until 2100-01-01 00:00:00" in str(refused.value)
    assert "--take-over" in str(refused.value) and read_lease(fs).owner == "f00d"
    taken = StoreLease.acquire(fs, run="mine", take_over=True, settle_s=0)
    assert read_lease(fs).owner == taken.info.owner and taken.epoch.epoch == 1
    assert read_lease(fs).expires_at <= time.time() + DEFAULT_TTL_S
    taken.release()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    foreign_lease(fs, expires_in=in_2100 - time.time(), host=socket.gethostname(), pid=dead.pid)
    assert StoreLease.acquire(fs, run="again", settle_s=0).epoch.epoch == 2


def test_renewal_extends_the_lease_and_notices_a_taker(tmp_path):
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    lease = StoreLease.acquire(fs, run="mine", ttl_s=30)
    first = read_lease(fs).expires_at
    time.sleep(0.01)
    lease.renew()
    assert read_lease(fs).expires_at > first
    taker = StoreLease.acquire(fs, run="other", take_over=True, settle_s=0)  # --take-over
    assert taker.epoch.epoch == lease.epoch.epoch + 1
    with pytest.raises(StoreBusyError, match="other"):
        lease.renew()
    assert lease.lost
    lease.release()  # not ours: left alone
    assert read_lease(fs).owner == taker.info.owner


def test_a_superseded_drivers_late_renewal_does_not_take_the_store_back(tmp_path):
    """A driver frozen between its renewal's check and its write overwrites the new owner's
    lease when it wakes: the epoch, not owner.json, says who owns the store, so the new owner
    keeps it and writes its lease back; the old one finds out it lost at its next renewal."""
    fs = StoreFS.open(str(tmp_path / "run"), fsync=False)
    old = StoreLease.acquire(fs, run="old", ttl_s=30)
    new = StoreLease.acquire(fs, run="new", take_over=True, settle_s=0)
    fs.write_bytes(LEASE_FILE, json.dumps(old.info.to_json()).encode())  # the frozen renewal lands
    new.renew()
    assert not new.lost and read_lease(fs).owner == new.info.owner
    with pytest.raises(StoreBusyError, match="epoch"):
        old.renew()
    assert old.lost


def test_staleness_is_decided_from_the_lease_alone():
    info = LeaseInfo(owner="a", host="h", pid=1, run="r", acquired_at=0.0, expires_at=100.0)
    assert stale_reason(info, now=50.0, host="elsewhere", pid=7) == ""
    assert "expired" in stale_reason(info, now=100.0, host="elsewhere", pid=7)


_CONTENDER = """
import sys, time
from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.lease import StoreLease
from layercheck.orchestrator.store.errors import StoreBusyError
fs = StoreFS.open(sys.argv[1], fsync=False)
while time.time() < float(sys.argv[2]):
    pass
try:
    StoreLease.acquire(fs, run=sys.argv[3])
    print("won")
    time.sleep(2)
except StoreBusyError as e:
    print("lost")
"""


def test_two_processes_starting_at_once_get_one_owner(tmp_path):
    start = time.time() + 1.5
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTENDER, str(tmp_path / "run"), str(start), f"r{i}"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outcomes == ["lost", "won"]


@pytest.mark.parametrize(
    "fail",
    [
        OSError(28, "No space left on device"),  # (root ignores chmod: the OS call fails instead)
        PermissionError(13, "Read-only file system"),
    ],
    ids=["full", "read-only"],
)
def test_a_full_or_read_only_store_is_one_clear_error_and_leaves_no_temporary(tmp_path, monkeypatch, fail):
    from layercheck.orchestrator.store.errors import StoreWriteError

    def failing_fsync(fd):
        raise fail

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StoreWriteError, match=r"owner\.json \(the run's lease; is the storage read-only or full\?\)"):
        StoreLease.acquire(StoreFS.open(str(tmp_path)), run="r")
    assert list(tmp_path.iterdir()) == []  # no owner.json, no owner.json.*.tmp


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_starts_taking_over_one_stale_lease_at_once_get_one_owner(tmp_path, request, monkeypatch, where):
    """Two ``--resume`` of a store whose driver was killed, started together: both find its lease
    stale, and the second's whole start runs between the first's read of that lease and its next
    step (scripted exactly: the rest is the real store). Both aim at the epoch after the newest
    they saw before reading the lease; the second opened it, so the first is refused naming it,
    and the store has one owner, whose lease and renewals stand."""
    import layercheck.orchestrator.store.lease as lease_module
    from layercheck.orchestrator.store.epochs import epoch_numbers

    uri = request.getfixturevalue("s3").uri("runs/x") if where == "s3" else str(tmp_path / "run")
    killed = StoreLease.acquire(StoreFS.open(uri, fsync=False), run="killed", settle_s=0)  # epoch 1
    lapsed = LeaseInfo(**{**killed.info.__dict__, "host": "gone-host", "expires_at": time.time() - 1})
    killed.fs.write_bytes(LEASE_FILE, json.dumps(lapsed.to_json()).encode())  # its driver died long ago

    read_the_stale_lease = lease_module.stale_reason
    second: list[StoreLease] = []

    def the_second_start_runs_meanwhile(info, **kwargs):
        reason = read_the_stale_lease(info, **kwargs)
        if not second:
            second.append(None)  # (its own read of the lease comes here too)
            second[0] = StoreLease.acquire(StoreFS.open(uri, fsync=False), run="second", settle_s=0)
        return reason

    monkeypatch.setattr(lease_module, "stale_reason", the_second_start_runs_meanwhile)
    fs = StoreFS.open(uri, fsync=False)
    with pytest.raises(StoreBusyError, match=r"epoch 2 \(run 'second'"):
        StoreLease.acquire(fs, run="first", settle_s=0)
    owner = second[0]
    assert epoch_numbers(fs) == [1, 2] and owner.epoch.epoch == 2
    assert read_lease(fs).owner == owner.info.owner  # the refused start left the owner's lease alone
    owner.renew()
    assert not owner.lost and read_lease(fs).owner == owner.info.owner


def test_a_directory_created_while_it_is_listed_is_listed_not_an_error(tmp_path):
    """Two starts at once both list ``epochs/`` first, while one of them creates it. pyarrow's
    local listing then finds the directory missing and, checking, present, and raises
    FileNotFoundError despite ``allow_not_found`` (seen in 3 of 100 such starts): that moment
    scripted, the listing is taken again instead of failing the start with a traceback."""
    import pyarrow.fs as pafs

    from layercheck.orchestrator.store.epochs import epoch_numbers
    from tests.support.store_helpers import FaultyLocalFS

    class CreatedWhileListed(FaultyLocalFS):
        raised = False

        def get_file_info_selector(self, selector):
            if not self.raised:
                self.raised = True
                StoreLease.acquire(StoreFS.open(str(tmp_path / "run"), fsync=False), run="other", settle_s=0)
                raise FileNotFoundError(2, f"Cannot list directory '{selector.base_dir}'")
            return super().get_file_info_selector(selector)

    fs = StoreFS(fs=pafs.PyFileSystem(CreatedWhileListed()), root=str(tmp_path / "run"))
    assert epoch_numbers(fs) == [1]
