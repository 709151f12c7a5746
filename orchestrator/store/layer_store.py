"""The layer store: versions of layer state as per-rank safetensors files plus a manifest.

Writing a version takes two kinds of call, so that each rank's shard can be written by a
different process and one coordinator commits:

* every writer: ``receipt = store.write_shard(shard, base=...)`` — writes one rank's file
  (atomically, checksummed) and returns a small :class:`ShardReceipt`;
* the coordinator, once it holds the receipts of all ranks:
  ``record = store.commit(receipts)`` — checks they form one whole version and writes its
  commit record last. Until then the files are invisible to readers; if the commit never
  comes they are orphans, collected by GC after a grace period.

See ``STORE_LAYOUT.md`` beside this file for the layout of a run.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from layercheck.orchestrator.store import tensorfile
from layercheck.orchestrator.store.epochs import EpochFence, epoch_numbers
from layercheck.orchestrator.store.errors import (
    ManifestError,
    PathOutsideStoreError,
    ShardFormatError,
    StoreUnavailableError,
)
from layercheck.orchestrator.store.fs import TMP_PATTERN, TOKEN_PATTERN, FaultHook, StoreFS, new_token, write_error
from layercheck.orchestrator.store.lease_term import LeaseTerm
from layercheck.orchestrator.store.manifest import (
    LAYER_NAME_PATTERN,
    LAYERS_DIR,
    MANIFEST_DIR,
    MEMORY_ORIGIN,
    ORIGINS,
    Manifest,
    ShardEntry,
    ShardReceipt,
    VersionRecord,
    check_layer_name,
    encode_record,
    read_manifest,
    record_path,
)
from layercheck.workers.shard import LayerShard

logger = logging.getLogger(__name__)

#: The run's config, as JSON, in the root of its store.
RUN_CONFIG_FILE = "run.json"
#: The config a ``--resume`` resumed from, kept when the resume writes its own ``run.json``.
PREVIOUS_RUN_CONFIG_FILE = "run.previous.json"
#: The run's drift trace (``layercheck simulate --trace`` replays it), in the root of its store.
DRIFT_TRACE_FILE = "drift_trace.json"


#: Origins a shard file's name carries (``policy`` is the unmarked default).
_NAMED_ORIGINS = ("capture", MEMORY_ORIGIN)


def shard_path(shard: LayerShard, *, base: bool, token: str, origin: str = "policy") -> str:
    kind = ("-base" if base else "") + (f"-{origin}" if origin in _NAMED_ORIGINS else "")
    return (
        f"{LAYERS_DIR}/{shard.layer}/{shard.step:010d}{kind}-rank{shard.rank:05d}of{shard.world_size:05d}"
        f"-{token}.safetensors"
    )


def _version_id(layer: str, step: int, *, base: bool, partial: bool = False) -> str:
    return f"{layer}@{step:010d}{'-base' if base else ''}{'-partial' if partial else ''}-{new_token()}"


# What LayerCheck's naming above says it wrote (``run_dir.owned_file``: what --overwrite and GC may
# delete; anything else is a user's and never touched). A change to the names must change these.
_STORED_ORIGINS = "|".join(o for o in _NAMED_ORIGINS if o != MEMORY_ORIGIN)  # a memory version is never stored
#: A shard file's path as :func:`shard_path` names it (any origin stored, base or not), or the
#: temporary of its atomic write.
SHARD_FILE = re.compile(
    rf"^{LAYERS_DIR}/{LAYER_NAME_PATTERN}/\d{{10}}(-base)?(-(?:{_STORED_ORIGINS}))?-rank\d{{5}}of\d{{5}}"
    rf"-{TOKEN_PATTERN}\.safetensors({TMP_PATTERN})?$"
)
#: A commit record's path (``record_path`` of a :func:`_version_id`: base, partial or both), or
#: the temporary of its atomic write.
RECORD_FILE = re.compile(
    rf"^{MANIFEST_DIR}/{LAYER_NAME_PATTERN}@\d{{10}}(-base)?(-partial)?-{TOKEN_PATTERN}\.json({TMP_PATTERN})?$"
)


@dataclass(frozen=True, kw_only=True)
class PreparedShard:
    """A shard file serialised in memory and the receipt it will have once written."""

    encoded: tensorfile.EncodedShard
    receipt: ShardReceipt


def _checked_path(shard: LayerShard, *, base: bool, origin: str) -> str:
    check_layer_name(shard.layer)
    if not 0 <= shard.rank < shard.world_size:
        raise ValueError(f"shard rank {shard.rank} is outside world size {shard.world_size}")
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
    return shard_path(shard, base=base, token=new_token(), origin=origin)


def _never_stored(origin: str) -> None:
    if origin == MEMORY_ORIGIN:
        raise ValueError("a memory version is held by the writers, never written to storage or committed")


def _receipt(shard: LayerShard, rel: str, digest: tensorfile.FileDigest, *, base: bool, origin: str) -> ShardReceipt:
    return ShardReceipt(
        layer=shard.layer,
        step=shard.step,
        rank=shard.rank,
        world_size=shard.world_size,
        base=base,
        path=rel,
        nbytes=digest.nbytes,
        checksum=digest.checksum,
        origin=origin,
        slices=tuple(shard.slices),
    )


class LayerStore:
    """A run's layer versions in one directory of any pyarrow filesystem."""

    def __init__(self, fs: StoreFS, *, opener: Callable[[str], tensorfile.RandomAccess] | None = None) -> None:
        self.fs = fs
        self.opener = opener
        """Opens a shard file for reading (a recovery's memory-first opener); ``None``: storage."""
        self.fence: EpochFence | None = None
        """The run's epoch: each commit record carries it, and its check before each commit
        refuses the commit once another run has taken the store over. ``None``: no lease (a
        process-local run, a test); its records take the store's newest epoch, so they count."""
        self.term: LeaseTerm | None = None
        """Until when the run's lease is valid, as its driver last renewed it: once it has lapsed,
        every shard write and commit is refused (``LeaseLapsedError``) before it touches the
        store. ``None``: no lease (a process-local run, a test)."""

    @classmethod
    def open(cls, uri: str, *, fsync: bool = True, hook: FaultHook | None = None) -> LayerStore:
        """Open the run at ``uri`` (a path, ``file://``, ``s3://``, ``gs://``…); creates nothing."""
        return cls(StoreFS.open(uri, fsync=fsync, hook=hook))

    @property
    def uri(self) -> str:
        return self.fs.uri()

    def __repr__(self) -> str:
        return f"LayerStore({self.uri!r})"

    # ---- writing --------------------------------------------------------------------------
    def write_shard(self, shard: LayerShard, *, base: bool = False, origin: str = "policy") -> ShardReceipt:
        """Write one rank's shard of a version; visible to readers only after :meth:`commit`.
        ``origin="capture"``: a survivor's hand-over at a failure (see :data:`ORIGINS`)."""
        _never_stored(origin)
        self._check_term()
        rel = _checked_path(shard, base=base, origin=origin)
        started = time.monotonic()
        digest = self.fs.write_atomic(
            rel,
            lambda stream: tensorfile.write_shard(
                stream, shard, base=base, after_header=lambda: self.fs.fire("partial", rel)
            ),
        )
        logger.debug("wrote %s (%d bytes) in %.3fs", self.fs.uri(rel), digest.nbytes, time.monotonic() - started)
        return _receipt(shard, rel, digest, base=base, origin=origin)

    @staticmethod
    def prepare_shard(shard: LayerShard, *, base: bool = False, origin: str = "policy") -> PreparedShard:
        """``shard``'s file serialised in memory, with its receipt: :meth:`write_prepared` writes it,
        and the writer keeps the bytes for recovery from memory."""
        rel = _checked_path(shard, base=base, origin=origin)
        encoded = tensorfile.encode_shard(shard, base=base)
        return PreparedShard(encoded=encoded, receipt=_receipt(shard, rel, encoded.digest, base=base, origin=origin))

    def write_prepared(self, prepared: PreparedShard) -> ShardReceipt:
        """Write a prepared shard file, as :meth:`write_shard` would (atomic, fsynced, same hook points)."""
        _never_stored(prepared.receipt.origin)
        self._check_term()
        rel, data, split = prepared.receipt.path, prepared.encoded.data, prepared.encoded.header_nbytes
        started = time.monotonic()

        def write(stream: pa.NativeFile) -> None:
            stream.write(data.slice(0, split))
            self.fs.fire("partial", rel)
            stream.write(data.slice(split))

        self.fs.write_atomic(rel, write)
        logger.debug("wrote %s (%d bytes) in %.3fs", self.fs.uri(rel), data.size, time.monotonic() - started)
        return prepared.receipt

    def commit(
        self, receipts: Sequence[ShardReceipt], *, check_files: bool = True, partial: bool = False
    ) -> VersionRecord:
        """Commit the version the ``receipts`` (one per rank) describe, by writing its record last.
        ``partial``: the receipts of only some ranks (survivors of a broken group), committed as a
        partial version that recovery overlays on a whole one.

        Raises :class:`ManifestError` if the receipts are not exactly one of each rank (``partial``:
        at most one of each) of one (layer, step, world size, base, origin) or, with
        ``check_files``, if a file is missing or has another size than its receipt;
        :class:`StoreWriteError` if the record cannot be written; :class:`LeaseLostError` if
        :attr:`fence` finds the store taken over, or :attr:`term` lapsed (``LeaseLapsedError``).
        Either way nothing is committed.
        """
        first = _check_receipts(receipts, partial=partial)
        _never_stored(first.origin)
        self._check_term()
        version_id = _version_id(first.layer, first.step, base=first.base, partial=partial)
        if check_files:
            try:
                self._check_receipt_files(receipts)
            except OSError as error:  # the store is unreachable: the commit fails like its write would
                raise write_error(self.fs.uri(record_path(version_id)), error) from error
        record = VersionRecord(
            version_id=version_id,
            layer=first.layer,
            step=first.step,
            world_size=first.world_size,
            base=first.base,
            committed_at=time.time(),
            shards=tuple(
                ShardEntry(rank=r.rank, path=r.path, nbytes=r.nbytes, checksum=r.checksum, slices=r.slices)
                for r in sorted(receipts, key=lambda r: r.rank)
            ),
            partial=partial,
            origin=first.origin,
            epoch=self.fence.epoch if self.fence is not None else max(epoch_numbers(self.fs), default=0),
        )
        if self.fence is not None:
            self.fence.check()
        self._check_term()  # again: the checks above read the store, which may have hung past the expiry
        self.fs.write_bytes(record_path(record.version_id), encode_record(record))
        logger.info(
            "committed %s: layer %s step %d%s, %s ranks, %d bytes",
            record.version_id,
            record.layer,
            record.step,
            " (base)" if record.base else "",
            f"{len(record.shards)} of {record.world_size}" if partial else record.world_size,
            record.nbytes,
        )
        return record

    def _check_term(self) -> None:
        if self.term is not None:
            self.term.check()

    def write_version(self, shards: Sequence[LayerShard], *, base: bool = False) -> VersionRecord:
        """Write every rank's shard of one version from this process, then commit it."""
        return self.commit([self.write_shard(shard, base=base) for shard in shards])

    def _check_receipt_files(self, receipts: Sequence[ShardReceipt]) -> None:
        for receipt in receipts:
            info = self.fs.info(receipt.path)
            if info.size != receipt.nbytes:
                found = "missing" if info.size is None else f"{info.size} bytes"
                raise ManifestError(
                    f"cannot commit layer {receipt.layer} step {receipt.step}: rank {receipt.rank}'s file "
                    f"{self.fs.uri(receipt.path)} is {found}, its receipt says {receipt.nbytes} bytes"
                )

    # ---- reading --------------------------------------------------------------------------
    def manifest(self) -> Manifest:
        return read_manifest(self.fs)

    def versions(self) -> tuple[VersionRecord, ...]:
        return self.manifest().records

    def open_file(self, rel: str) -> tensorfile.RandomAccess:
        return self.opener(rel) if self.opener is not None else self.fs.open_input(rel)

    def check_version(self, record: VersionRecord, *, deep: bool = True) -> list[str]:
        """Problems that make ``record`` unusable (empty if none). Always: every file exists,
        has its recorded size, its header matches the record and its checksum; with ``deep``
        every tensor's checksum too (reads every byte). Raises :class:`StoreUnavailableError`
        when the storage did not answer a read: that says nothing of the version."""
        problems = []
        for entry in record.shards:
            problem = self.check_shard(record, entry, deep=deep)
            if problem:
                problems.append(problem)
        return problems

    def check_shard(self, record: VersionRecord, entry: ShardEntry, *, deep: bool) -> str:
        where = self.fs.uri(entry.path)
        try:
            with self.fs.answered(entry.path):  # a read the storage did not answer finds no damage
                file = self.open_file(entry.path)
                try:
                    if file.size() != entry.nbytes:
                        return f"{where}: {file.size()} bytes, the manifest says {entry.nbytes} (truncated or replaced)"
                    header = tensorfile.read_header(file, path=where)
                    _check_header_matches(record, entry, header, where)
                    if deep:
                        for item in header.entries.values():
                            tensorfile.read_entry(file, item, path=where, count=0)
                finally:
                    file.close()
        except FileNotFoundError:
            return f"{where}: missing"
        except StoreUnavailableError:
            raise
        except (OSError, ShardFormatError, PathOutsideStoreError) as error:
            return str(error)
        return ""

    # ---- deleting -------------------------------------------------------------------------
    def delete_version(self, record: VersionRecord) -> int:
        """Uncommit ``record`` (its commit record goes first, so no reader can pick it up half
        deleted), then delete its files. Returns the bytes freed. Every path is checked first: a
        record naming a file outside the store (:class:`PathOutsideStoreError`) deletes nothing."""
        for entry in record.shards:
            self.fs.path(entry.path)
        self.fs.delete(record_path(record.version_id))
        freed = 0
        for entry in record.shards:
            if self.fs.delete(entry.path):
                freed += entry.nbytes
        logger.info("deleted version %s (%d bytes)", record.version_id, freed)
        return freed


def _check_receipts(receipts: Sequence[ShardReceipt], *, partial: bool = False) -> ShardReceipt:
    if not receipts:
        raise ManifestError("cannot commit a version without shard receipts")
    first = receipts[0]
    for r in receipts:
        if (r.layer, r.step, r.world_size, r.base, r.origin) != (
            first.layer,
            first.step,
            first.world_size,
            first.base,
            first.origin,
        ):
            raise ManifestError(
                f"receipts mix versions: {first.layer}@{first.step} (world {first.world_size}, base={first.base}, "
                f"{first.origin}) and {r.layer}@{r.step} (world {r.world_size}, base={r.base}, {r.origin})"
            )
    ranks = sorted(r.rank for r in receipts)
    whole = list(range(first.world_size))
    if partial and ranks == sorted(set(ranks)) and set(ranks) <= set(whole):
        return first
    if ranks != whole:
        missing = sorted(set(range(first.world_size)) - set(ranks))
        extra = sorted({r for r in ranks if ranks.count(r) > 1 or not 0 <= r < first.world_size})
        raise ManifestError(
            f"cannot commit layer {first.layer} step {first.step}: world size {first.world_size} needs "
            f"{'at most ' if partial else ''}one receipt per rank; missing ranks {missing}, duplicate or out-of-range ranks {extra}"
        )
    return first


def _check_header_matches(record: VersionRecord, entry: ShardEntry, header: tensorfile.ShardHeader, where: str) -> None:
    if header.file_nbytes != entry.nbytes:
        raise ShardFormatError(f"{where}: {header.file_nbytes} bytes, the manifest says {entry.nbytes}")
    if header.checksum != entry.checksum:
        raise ShardFormatError(f"{where}: header checksum {header.checksum}, the manifest says {entry.checksum}")
    found = (header.layer, header.step, header.rank, header.world_size)
    wanted = (record.layer, record.step, entry.rank, record.world_size)
    if found != wanted:
        raise ShardFormatError(f"{where}: holds (layer, step, rank, world) {found}, the manifest says {wanted}")
    if entry.slices is not None and tuple(header.slices) != entry.slices:
        raise ShardFormatError(f"{where}: holds slices {list(header.slices)}, the manifest says {list(entry.slices)}")
