"""The manifest: the persistence history of a run, one small JSON commit record per version.

A version (one layer at one step) is committed by writing its record ``manifest/{version_id}.json``
last, after every rank's shard file is written and checksummed. Records are never rewritten, so
committing is append-only: two writers committing different layers cannot lose each other's
entries, and a crash leaves either no record or a whole one. Reading the manifest is one
listing plus one small read per record; :func:`manifest_table` gives the history as an Arrow table.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from layercheck.orchestrator.store.epochs import EpochHistory, read_epochs
from layercheck.orchestrator.store.errors import ManifestError, PathOutsideStoreError, StoreUnavailableError
from layercheck.orchestrator.store.fs import TMP_SUFFIX, StoreFS, check_relative
from layercheck.policies.plan import INITIAL_ORIGIN, VersionRef
from layercheck.workers.shard import ParamSlice

logger = logging.getLogger(__name__)

RECORD_FORMAT = "layercheck.version/1"
#: Where a version's data came from: a snapshot the policy scheduled, a survivor's hand-over of
#: what it held when its worker group broke (see ``layercheck.orchestrator.core.capture``), or a
#: memory version (``persistence.memory_period``: held in the writers' memory, never stored, so
#: never a commit record: see ``orchestrator/core/memory/versions.py``).
MEMORY_ORIGIN = "memory"
ORIGINS = ("policy", "capture", MEMORY_ORIGIN)
MANIFEST_DIR = "manifest"
LAYERS_DIR = "layers"
#: The characters of a layer name (:func:`check_layer_name`), as a regular expression.
LAYER_NAME_PATTERN = r"[A-Za-z0-9_.\-]+"
_LAYER_NAME = re.compile(rf"^{LAYER_NAME_PATTERN}$")


def check_layer_name(layer: str) -> str:
    """Layer names become path components: letters, digits, ``_ . -`` only."""
    if not _LAYER_NAME.match(layer) or layer in (".", ".."):
        raise ValueError(f"layer name {layer!r} is not storable: use letters, digits, '_', '.', '-'")
    return layer


def record_path(version_id: str) -> str:
    return f"{MANIFEST_DIR}/{version_id}.json"


@dataclass(frozen=True, kw_only=True)
class ShardReceipt:
    """What writing one rank's shard returns, and what the committer needs from each rank:
    where the file is (relative to the run root), its size and its checksum. Plain values
    (picklable, JSON-able via :meth:`to_json`), so it travels between actors."""

    layer: str
    step: int
    rank: int
    world_size: int
    base: bool
    path: str
    nbytes: int
    checksum: str
    origin: str = "policy"
    """``policy`` or ``capture`` (:data:`ORIGINS`): receipts of different origins never make one version."""
    slices: tuple[ParamSlice, ...] | None = None
    """The parameter ranges the file holds (its header's ``slices``); ``None``: not said."""

    def to_json(self) -> dict[str, object]:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}  # (asdict would copy the slices)
        return {**fields, "slices": slices_json(self.slices)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardReceipt:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**fields, "slices": parse_slices(data.get("slices"), source="a shard receipt")})


def slices_json(slices: Sequence[ParamSlice] | None) -> list[list[object]] | None:
    """``[name, shape, offset, length]`` per slice (compact: a record names N files' worth)."""
    return None if slices is None else [[s.name, list(s.shape), s.offset, s.length] for s in slices]


def parse_slices(raw: Any, *, source: str) -> tuple[ParamSlice, ...] | None:
    """The slices :func:`slices_json` wrote (``None`` stays ``None``: a record written before them)."""
    if raw is None:
        return None
    try:
        return tuple(
            ParamSlice(name=str(name), shape=tuple(int(d) for d in shape), offset=int(offset), length=int(length))
            for name, shape, offset, length in raw
        )
    except (TypeError, ValueError) as error:
        raise ManifestError(f"{source}: malformed slices ({error!r})") from error


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One rank's file of a committed version."""

    rank: int
    path: str
    """Relative to the store's root, under ``layers/``; anything else makes the record damaged."""
    nbytes: int
    checksum: str
    slices: tuple[ParamSlice, ...] | None = None
    """Which elements of which parameters the file holds, as its header says (checked against it
    whenever the header is read): a reader finds the files holding a range without reading every
    file's header. ``None``: a record written before they were kept (every header is read)."""

    def __post_init__(self) -> None:
        try:
            check_relative(self.path)
        except PathOutsideStoreError as error:
            raise ManifestError(f"shard path {error}") from error
        if not self.path.startswith(LAYERS_DIR + "/"):
            raise ManifestError(f"shard path {self.path!r} is not under {LAYERS_DIR}/: refused")


@dataclass(frozen=True, kw_only=True)
class VersionRecord:
    """One committed version: a layer's state at one step, as ``world_size`` rank files — or,
    ``partial``, as the files of only some ranks (what survivors of a broken group held: each
    file's header says which elements it covers; recovery takes the rest from other versions)."""

    version_id: str
    layer: str
    step: int
    world_size: int
    base: bool
    committed_at: float
    """Unix time of the commit."""
    shards: tuple[ShardEntry, ...]
    partial: bool = False
    origin: str = "policy"
    epoch: int = 0
    """The epoch of the lease it was committed under (``epochs.py``); 0: no lease (a store written
    before epochs, or by a tool with no lease)."""

    def __post_init__(self) -> None:
        ranks = [s.rank for s in self.shards]
        if self.origin == INITIAL_ORIGIN:  # a plan's placeholder for the rebuilt step-0 state (initial_state.py)
            if self.shards or self.world_size or self.step or self.partial:
                raise ManifestError(f"version {self.version_id}: an initial-state placeholder has no files, step 0")
            return
        if self.origin not in ORIGINS:
            raise ManifestError(f"version {self.version_id}: origin must be one of {ORIGINS}, got {self.origin!r}")
        if self.partial:
            if not ranks or ranks != sorted(set(ranks)) or not all(0 <= r < self.world_size for r in ranks):
                raise ManifestError(
                    f"version {self.version_id}: a partial version needs some of ranks 0..{self.world_size - 1} "
                    f"in order, got {ranks}"
                )
        elif ranks != list(range(self.world_size)):
            raise ManifestError(
                f"version {self.version_id}: shards must be ranks 0..{self.world_size - 1} in order, got {ranks}"
            )

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def is_initial(self) -> bool:
        """The run's rebuilt step-0 state (no files: nothing to read), never a stored record."""
        return self.origin == INITIAL_ORIGIN

    @property
    def ref(self) -> VersionRef:
        return VersionRef(
            step=self.step,
            layer=self.layer,
            version_id=self.version_id,
            base=self.base,
            partial=self.partial,
            origin=self.origin,
        )

    def to_json(self) -> dict[str, object]:
        # (not asdict: it deep-copies every shard entry, N of them, only for them to be replaced)
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "shards"}
        return {"format": RECORD_FORMAT, **fields, "shards": [_entry_json(s) for s in self.shards]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str) -> VersionRecord:
        if data.get("format") != RECORD_FORMAT:
            raise ManifestError(f"{source}: format is {data.get('format')!r}, expected {RECORD_FORMAT!r}")
        try:
            record = cls(
                version_id=str(data["version_id"]),
                layer=str(data["layer"]),
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                base=bool(data["base"]),
                committed_at=float(data["committed_at"]),
                shards=tuple(
                    ShardEntry(
                        rank=int(s["rank"]),
                        path=str(s["path"]),
                        nbytes=int(s["nbytes"]),
                        checksum=str(s["checksum"]),
                        slices=parse_slices(s.get("slices"), source=source),
                    )
                    for s in data["shards"]
                ),
                partial=bool(data.get("partial", False)),
                origin=str(data.get("origin", "policy")),
                epoch=int(data.get("epoch", 0)),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"{source}: malformed commit record ({error!r})") from error
        if record.is_initial:
            raise ManifestError(f"{source}: a commit record cannot be an initial-state placeholder: damaged")
        if record.origin == MEMORY_ORIGIN:
            raise ManifestError(f"{source}: a commit record cannot be a memory version (never stored): damaged")
        record.check_names(source=source)
        return record

    def check_names(self, *, source: str) -> None:
        """The record's fields agree with the names it was committed under: its version id and
        every shard file name carry the layer, the step, the base/partial flags and the ranks
        (see ``layer_store.shard_path``). A record edited or damaged after its commit (a step of
        400 in a step-40 record, say) disagrees, and is damaged, never believed."""
        flags = ("-base" if self.base else "") + ("-partial" if self.partial else "")
        if not re.fullmatch(rf"{re.escape(self.layer)}@{self.step:010d}{flags}-\w+", self.version_id):
            raise ManifestError(
                f"{source}: version id {self.version_id!r} does not name layer {self.layer!r} step {self.step} "
                f"({'base' if self.base else 'not base'}, {'partial' if self.partial else 'whole'}): damaged"
            )
        prefix = f"{LAYERS_DIR}/{self.layer}/{self.step:010d}"
        for s in self.shards:
            if not (s.path.startswith(prefix) and f"-rank{s.rank:05d}of{self.world_size:05d}-" in s.path):
                raise ManifestError(
                    f"{source}: shard {s.path!r} does not name layer {self.layer!r} step {self.step} rank {s.rank} "
                    f"of {self.world_size}: damaged"
                )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Every committed version (by step, then layer), and the records that could not be read."""

    records: tuple[VersionRecord, ...]
    problems: tuple[str, ...] = ()
    claimed: frozenset[str] = frozenset()
    """Paths named by the records in ``problems``: not the manifest's, not orphans either."""
    claims_unknown: bool = False
    """A record in ``problems`` is not even JSON: any uncommitted file may be one it names."""
    fenced: tuple[tuple[VersionRecord, str], ...] = ()
    """Well-formed records that do not count, each with why: a superseded owner's commits after
    the takeover (``epochs.py``). Never planned from; ``layercheck gc`` deletes them."""

    def by_id(self) -> dict[str, VersionRecord]:
        return {r.version_id: r for r in self.records}

    def refs(self) -> list[VersionRef]:
        return [r.ref for r in self.records]

    def layers(self) -> list[str]:
        """Layer names in first-committed order (the base lists every layer)."""
        return list(dict.fromkeys(r.layer for r in self.records))


def _entry_json(entry: ShardEntry) -> dict[str, object]:
    out: dict[str, object] = {
        "rank": entry.rank,
        "path": entry.path,
        "nbytes": entry.nbytes,
        "checksum": entry.checksum,
    }
    return out if entry.slices is None else {**out, "slices": slices_json(entry.slices)}


def encode_record(record: VersionRecord) -> bytes:
    return json.dumps(record.to_json(), indent=1).encode()


@dataclass(frozen=True)
class _Unreadable:
    """A commit record that cannot be used, and the shard paths it names where they can be told."""

    problem: str
    claims: tuple[str, ...] | None
    """The ``shards[].path`` strings of its JSON; None: not JSON, so what it names is unknown."""


def _claims(raw: bytes) -> tuple[str, ...] | None:
    try:
        shards = json.loads(raw).get("shards")
    except (ValueError, AttributeError):
        return None
    if not isinstance(shards, list):
        return None
    return tuple(s["path"] for s in shards if isinstance(s, dict) and isinstance(s.get("path"), str))


def _read_record(store: StoreFS, rel: str) -> VersionRecord | _Unreadable | None:
    try:
        raw = store.read_bytes(rel)
    except FileNotFoundError:
        return None  # deleted by GC between listing and reading: not committed any more
    except StoreUnavailableError:
        raise  # the storage did not answer: nothing is known of the record, least of all that it is torn
    except OSError as error:
        return _Unreadable(f"{store.uri(rel)}: unreadable commit record ({error})", None)
    try:
        record = VersionRecord.from_json(json.loads(raw), source=store.uri(rel))
    except ValueError as error:
        return _Unreadable(f"{store.uri(rel)}: unreadable commit record ({error})", _claims(raw))
    if record_path(record.version_id) != rel:
        problem = f"{store.uri(rel)}: record names version {record.version_id!r}, not its file name"
        return _Unreadable(problem, tuple(s.path for s in record.shards))
    return record


def _record_files(store: StoreFS) -> list[str]:
    return [rel for rel, _ in store.list_files(MANIFEST_DIR) if rel.endswith(".json") and not rel.endswith(TMP_SUFFIX)]


def listed_version_ids(store: StoreFS) -> frozenset[str]:
    """The version ids of every commit record in the store, from one listing (nothing read)."""
    return frozenset(rel[len(MANIFEST_DIR) + 1 : -len(".json")] for rel in _record_files(store))


def read_manifest(store: StoreFS, *, threads: int = 16) -> Manifest:
    """List and read every commit record. A malformed record (torn by a crash on a filesystem
    without fsync, a newer format, a path leaving the store) is reported in ``problems`` and left
    out, never trusted; the files it names are never taken for orphans (``claimed``). A record
    the epochs fence out (``epochs.py``) is left out too, in ``fenced``."""
    names = _record_files(store)
    if len(names) > 1 and threads > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(names))) as pool:
            results = list(pool.map(lambda rel: _read_record(store, rel), names))
    else:
        results = [_read_record(store, rel) for rel in names]
    # after the listing: an epoch opened since sealed every record listed; of the epoch files,
    # only those the records need (their own, and the one after each, whose seal decides them)
    parsed = [r for r in results if isinstance(r, VersionRecord)]
    history = read_epochs(store, record_epochs={r.epoch for r in parsed})
    records, fenced, unreadable = _apply_epochs(store, parsed, history)
    unreadable += [r for r in results if isinstance(r, _Unreadable)]
    for bad in unreadable:
        logger.warning("manifest: %s; ignoring it", bad.problem)
    records.sort(key=lambda r: (r.step, r.layer, r.version_id))
    return Manifest(
        records=tuple(records),
        problems=tuple(bad.problem for bad in unreadable),
        claimed=frozenset(path for bad in unreadable for path in bad.claims or ()),
        claims_unknown=any(bad.claims is None for bad in unreadable),
        fenced=tuple(fenced),
    )


def _apply_epochs(
    store: StoreFS, records: list[VersionRecord], history: EpochHistory
) -> tuple[list[VersionRecord], list[tuple[VersionRecord, str]], list[_Unreadable]]:
    """``records`` split by the epochs' rule: those that count, those fenced out (with why), and
    the damaged (an epoch that was never opened, a step past its epoch's run; an unreadable
    epoch file)."""
    kept, fenced = [], []
    damaged = [_Unreadable(problem, ()) for problem in history.problems]
    for record in records:
        limit = history.beyond_its_run(record.step, record.epoch)
        why = (
            f"claims epoch {record.epoch}, but the store's newest is {history.newest}"
            if history.claims_unopened(record.epoch)
            else f"claims step {record.step}, but the run of its epoch {record.epoch} trains {limit} steps"
            if limit is not None
            else ""
        )
        if why:  # its files are claimed: not orphans either
            where = store.uri(record_path(record.version_id))
            damaged.append(_Unreadable(f"{where}: {why}: damaged", tuple(s.path for s in record.shards)))
            continue
        fencing = history.fenced_out(record.version_id, record.epoch)
        if fencing is None:
            kept.append(record)
            continue
        why = f"written under epoch {record.epoch} after {fencing.describe()} took the store over"
        logger.warning("manifest: %s was %s: fenced out, ignoring it", record.version_id, why)
        fenced.append((record, why))
    return kept, fenced, damaged


_SCHEMA = pa.schema(
    [
        ("version_id", pa.string()),
        ("layer", pa.string()),
        ("step", pa.int64()),
        ("base", pa.bool_()),
        ("world_size", pa.int32()),
        ("nbytes", pa.int64()),
        ("committed_at", pa.timestamp("ms", tz="UTC")),
        ("files", pa.list_(pa.string())),
        ("file_nbytes", pa.list_(pa.int64())),
        ("checksums", pa.list_(pa.string())),
    ]
)


def manifest_table(records: Iterable[VersionRecord] | Manifest) -> pa.Table:
    """The history as an Arrow table, one row per committed version."""
    rows: Sequence[VersionRecord] = records.records if isinstance(records, Manifest) else list(records)
    return pa.table(
        {
            "version_id": [r.version_id for r in rows],
            "layer": [r.layer for r in rows],
            "step": [r.step for r in rows],
            "base": [r.base for r in rows],
            "world_size": [r.world_size for r in rows],
            "nbytes": [r.nbytes for r in rows],
            "committed_at": [int(r.committed_at * 1000) for r in rows],
            "files": [[s.path for s in r.shards] for r in rows],
            "file_nbytes": [[s.nbytes for s in r.shards] for r in rows],
            "checksums": [[s.checksum for s in r.shards] for r in rows],
        },
        schema=_SCHEMA,
    )
