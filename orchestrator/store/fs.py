"""The store's view of a filesystem: a root inside any ``pyarrow.fs`` filesystem, atomic writes
and error messages that name the path and the cause.

One URI scheme covers local disk, NFS and object stores (``file://``, plain paths, ``s3://``,
``gs://``, ``abfs://``, ``hdfs://``) through :meth:`pyarrow.fs.FileSystem.from_uri`.

Atomicity (the idea of Orbax's ``path/atomicity.py``): on filesystems with an atomic rename a
file is written under a temporary name (``*.tmp``) and renamed into place; object stores have no
atomic rename (it is copy + delete), but a single PUT is atomic — the object appears whole or
not at all — so there the file is written straight to its final name. Either way a reader never
sees a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import random
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from layercheck.orchestrator.store.errors import PathOutsideStoreError, StoreWriteError
from layercheck.orchestrator.store.unavailable import ACCESS_HINT, is_refusal, is_throttled, unavailable_error
from layercheck.orchestrator.store.uri import open_uri

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Filesystems whose writes are single atomic PUTs and whose rename is not atomic.
OBJECT_STORES: frozenset[str] = frozenset({"s3", "gcs", "abfs"})

_SCHEMES = {"s3": "s3", "gcs": "gs", "abfs": "abfs", "hdfs": "hdfs"}

#: Suffix of a file being written; never referenced by the manifest.
TMP_SUFFIX = ".tmp"

#: What :func:`new_token` returns, as a regular expression (for the names LayerCheck recognises as its own).
TOKEN_PATTERN = r"[0-9a-f]{8}"
#: What :meth:`StoreFS.write_atomic` and :func:`create_exclusive` append to the name of a file
#: being written (``.{token}.tmp``), as a regular expression.
TMP_PATTERN = rf"\.{TOKEN_PATTERN}{re.escape(TMP_SUFFIX)}"

#: How long one store operation keeps backing off and trying again while the storage says to slow
#: down (S3's ``503 SlowDown``, a ``429``), beyond the S3 client's own few retries: S3 throttles a
#: prefix past its request rate (about 3,500 writes a second), which the writers of many ranks
#: reach at once. Past it the operation fails as any other would (the version is counted lost,
#: the layer persisted again; a breach stops the run).
THROTTLED_FOR_S = 30.0

#: ``hook(event, path)``: called at fixed points of a write so that tests can crash the writer
#: exactly there. Events: ``"opened"``, ``"partial"`` (by the writer callback), ``"closed"``,
#: ``"renamed"``.
FaultHook = Callable[[str, str], None]


def new_token() -> str:
    """A short random token that keeps names written by concurrent writers apart (:data:`TOKEN_PATTERN`)."""
    return secrets.token_hex(4)


def write_error(location: str, error: BaseException) -> StoreWriteError:
    """A :class:`StoreWriteError` for ``location`` that keeps the errno of ``error`` (and, when the
    storage refused the credentials, says what to check)."""
    message = f"cannot write {location}: {_cause(error)}" + (f"; {ACCESS_HINT}" if is_refusal(error) else "")
    errno = getattr(error, "errno", None)
    return StoreWriteError(errno, message) if errno else StoreWriteError(message)


def while_throttled(what: str, call: Callable[[], T]) -> T:
    """``call()``, tried again after a growing, jittered pause each time the storage throttles it,
    for up to :data:`THROTTLED_FOR_S` in all; any other error, or throttling past that, raises."""
    pause, waited = 0.2, 0.0
    while True:
        try:
            return call()
        except OSError as error:
            if not is_throttled(error):
                raise
            if waited >= THROTTLED_FOR_S:
                raise OSError(
                    f"{_cause(error)} (the storage kept throttling it, HTTP 503 SlowDown, for {waited:.1f}s: "
                    "its request rate is over the limit)"
                ) from error
            sleep = min(random.uniform(pause / 2, pause), THROTTLED_FOR_S - waited)
            logger.info("storage throttled %s (%s); trying again in %.2fs", what, _cause(error), sleep)
            time.sleep(sleep)
            waited += sleep
            pause = min(2 * pause, 5.0)


def check_relative(rel: str) -> str:
    """``rel`` if it names a place inside a store's root (relative, no ``..`` component), else
    :class:`PathOutsideStoreError`. Paths come from commit records too, which a damaged or hostile
    store controls: every path the store reads, writes or deletes passes here first."""
    if rel.startswith("/") or "\\" in rel or ".." in rel.split("/"):
        raise PathOutsideStoreError(f"{rel!r} leaves the store (absolute, '..' or a backslash): refused")
    return rel


def _cause(error: BaseException) -> str:
    errno = getattr(error, "errno", None)
    if errno:
        return f"{os.strerror(errno)} ({error})"
    return str(error) or type(error).__name__


@dataclass(frozen=True, kw_only=True)
class StoreFS:
    """A directory (``root``) inside a pyarrow filesystem; every path argument is relative to it."""

    fs: pafs.FileSystem
    """The filesystem (local, S3, GCS, HDFS, or a wrapped one in tests)."""
    root: str
    """The run's directory inside ``fs``, without a trailing slash."""
    atomic_rename: bool = True
    """Write to a temporary name and rename (local, NFS, HDFS); False: write in place (object stores)."""
    fsync: bool = False
    """fsync files and their directory after writing (local filesystems only)."""
    hook: FaultHook | None = None
    """Fault-injection hook for tests; None in production."""
    query: str = ""
    """The storage URI's query (``endpoint_override=…&scheme=http``), secrets redacted: locations
    in messages carry it, so they name the endpoint as well as the path."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("root must name a directory, got an empty string")

    @classmethod
    def open(cls, uri: str, *, fsync: bool = True, hook: FaultHook | None = None) -> StoreFS:
        """Open ``uri`` (``s3://bucket/run``, ``gs://…``, ``file:///…`` or a plain path); an
        S3-compatible server's endpoint and LayerCheck's S3 client options go in the query
        (``orchestrator/store/uri.py``)."""
        if "://" not in uri:
            uri = os.path.abspath(uri)
        opened = open_uri(uri)
        kind = opened.fs.type_name
        return cls(
            fs=opened.fs,
            root=opened.root.rstrip("/") or "/",
            atomic_rename=kind not in OBJECT_STORES,
            fsync=fsync and kind == "local",
            hook=hook,
            query=opened.query,
        )

    # ---- naming ---------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """The full path of ``rel`` inside the root; :class:`PathOutsideStoreError` if it would
        leave it, by its name or (on a local filesystem) through a symbolic link."""
        if not rel:
            return self.root
        full = f"{self.root}/{check_relative(rel)}"
        if self.fs.type_name == "local":
            real = os.path.realpath(full)
            if real != self._real_root and not real.startswith(self._real_root.rstrip("/") + "/"):
                raise PathOutsideStoreError(f"{rel!r} leads to {real}, outside the store {self._real_root}: refused")
        return full

    @functools.cached_property
    def _real_root(self) -> str:
        return posixpath.normpath(os.path.realpath(self.root))

    def uri(self, rel: str = "") -> str:
        """The full location, for messages: with the URI's query (an S3-compatible server's
        endpoint), never with credentials."""
        scheme = _SCHEMES.get(self.fs.type_name)
        full = f"{self.root}/{rel}" if rel else self.root  # a name for a message, even of a refused path
        where = f"{scheme}://{full.lstrip('/')}" if scheme else full
        return f"{where}?{self.query}" if self.query else where

    def fire(self, event: str, rel: str) -> None:
        if self.hook is not None:
            self.hook(event, rel)

    # ---- writing --------------------------------------------------------------------------
    def write_atomic(self, rel: str, write: Callable[[pa.NativeFile], T]) -> T:
        """Write ``rel`` with ``write(stream)``; the file appears under its name only complete.

        Raises :class:`StoreWriteError` naming the path and the cause (read-only, no space…);
        a temporary left behind by a failure is removed when possible, else GC collects it.
        """
        target = self.path(rel)
        staging = f"{target}.{new_token()}{TMP_SUFFIX}" if self.atomic_rename else target

        def attempt() -> T:
            self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            with self.fs.open_output_stream(staging) as stream:
                self.fire("opened", rel)
                written = write(stream)
            self.fire("closed", rel)
            if self.fsync:
                _fsync_file(staging)
            if self.atomic_rename:
                self.fs.move(staging, target)
            return written

        try:
            result = while_throttled(f"the write of {rel}", attempt)
        except OSError as error:
            self._discard(staging)
            raise write_error(self.uri(rel), error) from error
        except BaseException:
            self._discard(staging)
            raise
        # Past the rename the file is in place: a failure now must not report it unwritten.
        if self.fsync and self.atomic_rename:
            try:
                _fsync_file(os.path.dirname(target))
            except OSError as error:
                logger.warning("wrote %s but could not fsync its directory: %s", self.uri(rel), error)
        self.fire("renamed", rel)
        return result

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.write_atomic(rel, lambda stream: stream.write(data))

    def _discard(self, full_path: str) -> None:
        try:
            self.fs.delete_file(full_path)
        except OSError:
            pass  # it may never have been created; GC collects it otherwise

    # ---- reading and listing --------------------------------------------------------------
    # Each raises :class:`StoreUnavailableError` (:class:`StoreAccessError`) naming the store when
    # the storage did not answer (refused the credentials): not an answer about the file.
    def read_bytes(self, rel: str) -> bytes:
        def read() -> bytes:
            with self.fs.open_input_stream(self.path(rel)) as stream:
                return stream.read()

        with self.answered(rel):
            return while_throttled(f"the read of {rel}", read)

    def open_input(self, rel: str) -> pa.NativeFile:
        with self.answered(rel):
            return while_throttled(f"the read of {rel}", lambda: self.fs.open_input_file(self.path(rel)))

    def info(self, rel: str) -> pafs.FileInfo:
        with self.answered(rel):
            return while_throttled(f"a look at {rel}", lambda: self.fs.get_file_info(self.path(rel)))

    def list_files(self, rel_dir: str, *, recursive: bool = False) -> list[tuple[str, pafs.FileInfo]]:
        """``(relative path, info)`` of every file under ``rel_dir``; empty if it does not exist."""
        selector = pafs.FileSelector(self.path(rel_dir), allow_not_found=True, recursive=recursive)
        prefix = self.root.rstrip("/") + "/"
        out = []
        with self.answered(rel_dir):
            try:
                listed = while_throttled(f"the list of {rel_dir}", lambda: self.fs.get_file_info(selector))
            except FileNotFoundError:
                # created while it was listed (another run's first write into it: two starts at
                # once both list epochs/): pyarrow found it missing, then present, and raises
                # despite allow_not_found; listed again, it is there
                listed = self.fs.get_file_info(selector)
        for info in listed:
            if info.type == pafs.FileType.File:
                out.append((info.path[len(prefix) :] if info.path.startswith(prefix) else info.path, info))
        return sorted(out, key=lambda item: item[0])

    def delete(self, rel: str) -> bool:
        """Delete ``rel``; False if it was already gone."""
        try:
            with self.answered(rel):
                while_throttled(f"the delete of {rel}", lambda: self.fs.delete_file(self.path(rel)))
            return True
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def answered(self, rel: str) -> Iterator[None]:
        """Re-raise an ``OSError`` of the block that says the storage did not answer (or refused
        this process) as :class:`StoreUnavailableError` (:class:`StoreAccessError`) naming
        ``rel``'s location; any other error (a missing file, a local disk's) passes unchanged."""
        try:
            yield
        except OSError as error:
            unavailable = unavailable_error(self.uri(rel), error)
            if unavailable is None:
                raise
            raise unavailable from error


def create_exclusive(fs: StoreFS, rel: str, data: bytes, *, what: str) -> None:
    """Write ``rel`` on a local filesystem only if it does not exist (a hard link of a complete,
    fsynced temporary file). :class:`FileExistsError` if it does; :class:`StoreWriteError` naming
    ``what`` if the storage refuses the write. No temporary is left either way."""
    target = fs.path(rel)
    staging = f"{target}.{new_token()}{TMP_SUFFIX}"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(staging, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.link(staging, target)  # fails if another process published first
    except FileExistsError:
        raise
    except OSError as error:  # read-only, full, no such mount: before anything else is written
        raise write_error(f"{fs.uri(rel)} ({what}; is the storage read-only or full?)", error) from None
    finally:
        try:
            os.unlink(staging)
        except FileNotFoundError:
            pass


def _fsync_file(path: str) -> None:
    """Make a local file (or directory entry) durable; a crash after a rename must not leave
    an empty file under the final name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
