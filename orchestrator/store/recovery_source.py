"""Recovery from the store: a plan whose every version is usable, and exact-range reads.

* :func:`resolve_plan` (once, in the supervisor): plan → validate the chosen versions (each
  layer's whole version and the partial ones overlaid on it) → re-plan skipping any unusable
  one (missing, truncated or corrupt shard), until every layer's choice is usable; the previous
  committed version of a layer (or the base, or the run's rebuilt initial state where it
  recorded one: :mod:`~layercheck.orchestrator.store.initial_state`) takes over. The plan then says, from the overlays'
  shard headers, which source supplies how many elements of each layer, and at which step.
* :class:`VersionReader` (on each rank): ``read(param, key, offset, length)`` returns exactly
  that range of one parameter's flattened state, assembled from whichever stored rank files
  overlap it, whatever world size they were written at. It fetches only the tensor entries it
  needs, and checks each entry's checksum the first time it uses it.

:class:`~layercheck.orchestrator.store.composite_reader.CompositeReader` reads a whole plan's composite.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where ranges are read into tensors: the supervisor plans without torch
    import torch

from layercheck.orchestrator.store import tensorfile
from layercheck.orchestrator.store.errors import CorruptShardError, ManifestError, ShardFormatError
from layercheck.orchestrator.store.initial_state import read_initial
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.manifest import MEMORY_ORIGIN, Manifest, VersionRecord
from layercheck.orchestrator.store.unavailable import unavailable_error
from layercheck.policies.overlay import LayerSource, Span
from layercheck.policies.plan import (
    NoUsableVersionError,
    RecoveryPlan,
    VersionRef,
    newest_recoverable_step,
    plan_recovery,
    with_sources,
)
from layercheck.workers.shard import STATE_KEYS, ParamSlice

logger = logging.getLogger(__name__)

#: Threads a plan checks the chosen versions' files on (round trips to storage, most of their time).
CHECK_THREADS = 16


@dataclass(frozen=True, kw_only=True)
class ResolvedPlan:
    """A recovery plan whose every chosen version was checked usable, with its records.
    Plain values: it can be sent to every rank."""

    plan: RecoveryPlan
    records: Mapping[str, VersionRecord]
    """layer → the committed whole version to load."""
    skipped: Mapping[str, str]
    """version id → why it was found unusable."""
    overlays: Mapping[str, tuple[VersionRecord, ...]] = field(default_factory=dict)
    """layer → partial versions overlaid on its whole version, newest first (only layers that have some)."""

    @property
    def sources(self) -> dict[str, tuple[LayerSource, ...]]:
        """layer → where its elements come from: overlays newest first, then the whole version."""
        return {c.layer: c.sources for c in self.plan.choices}


def resolve_plan(
    store: LayerStore,
    layer_numel: Mapping[str, int],
    t_fail: int | None = None,
    *,
    deep: bool = True,
    skip: Mapping[str, str] | Collection[str] = (),
    manifest: Manifest | None = None,
    memory: Sequence[VersionRecord] = (),
    held: Collection[str] | None = None,
) -> ResolvedPlan:
    """Plan recovery at ``t_fail`` (default: the newest recoverable step of the versions found
    usable, recomputed after each rejection: a ``--resume``'s, a restarted driver's, ``export``'s)
    from versions that are usable: the stored ones and the writers' ``memory`` versions
    (``persistence.memory_period``), a memory version usable while the live writers hold all its files (``held``; ``None``: not
    known, then it counts as held and a file gone by the load falls back as a corrupt one does). ``deep`` reads every byte of each chosen version to verify its checksums; without
    it only sizes and headers are checked and :class:`VersionReader` catches a bad tensor later
    (raising :class:`CorruptShardError`; call again with that version in ``skip``).

    Raises :class:`NoUsableVersionError` naming each layer left without a usable version, what
    was tried, and why each skipped version was unusable.
    """
    manifest = store.manifest() if manifest is None else manifest
    initial = _initial_records(store, layer_numel)
    extra = [*initial, *(r for r in memory if r.layer in layer_numel)]
    by_id = {**manifest.by_id(), **{r.version_id: r for r in extra}}
    refs = manifest.refs() + [r.ref for r in extra]
    skipped: dict[str, str] = dict(skip) if isinstance(skip, Mapping) else dict.fromkeys(skip, "skipped by caller")
    usable: dict[str, dict[str, list[Span]]] = {}
    # the default step is where the versions the plan accepts say the run got to: a rejected
    # version's step (a record renamed to a later step, say) must not skip steps of data and schedule
    default = t_fail is None
    step = _recovery_point(layer_numel, refs, skipped) if t_fail is None else t_fail
    if step is None:
        have = {r.layer for r in refs if not r.partial and r.version_id not in skipped}
        why = "; ".join(f"{vid}: {reason}" for vid, reason in skipped.items())
        raise NoUsableVersionError(
            f"{store.uri}: no recovery point: no committed version of {sorted(set(layer_numel) - have)}"
            + (f". Unusable: {why}" if why else "")
        )
    while True:
        try:
            plan = plan_recovery(layer_numel, refs, step, skip=skipped)
        except NoUsableVersionError as error:
            why = "; ".join(f"{vid}: {reason}" for vid, reason in skipped.items())
            raise NoUsableVersionError(f"{store.uri}: {error}" + (f". Unusable: {why}" if why else "")) from error
        fresh_problems = False
        unchecked = {
            ref.version_id: (choice.layer, ref)
            for choice in plan.choices
            for ref in (choice.version, *choice.overlays)
            if ref.version_id not in usable
        }
        found = _problems(store, [by_id[vid] for vid in unchecked], deep=deep, usable=usable, held=held)
        for vid, problem in found.items():
            layer, ref = unchecked[vid]
            skipped[vid] = problem
            fresh_problems = True
            logger.warning(
                "recovery: %s version %s of layer %s is unusable (%s); re-planning without it",
                "partial" if ref.partial else "whole",
                vid,
                layer,
                problem,
            )
        if not fresh_problems:
            break
        if default:
            # (None: a layer has no usable version left; the plan at the old step names it and what was tried)
            newest = _recovery_point(layer_numel, refs, skipped)
            if newest is not None and newest != step:
                logger.warning(
                    "recovery: without the unusable versions the newest recoverable step is %d, not %d",
                    newest,
                    step,
                )
                step = newest
    ranks = {vid: tuple(s.rank for s in by_id[vid].shards) for vid in usable}
    plan = with_sources(plan, layer_numel, usable, ranks)
    overlays = {c.layer: tuple(by_id[o.version_id] for o in c.overlays) for c in plan.choices if c.overlays}
    logger.info(
        "recovery plan at step %d: max staleness %d, weighted %.1f (element-weighted), %d layer(s) with "
        "partial versions overlaid, %d version(s) skipped, %d passed over",
        plan.t_fail,
        plan.max_staleness,
        plan.weighted_staleness,
        len(overlays),
        len(skipped),
        len(plan.passed_over),
    )
    return ResolvedPlan(
        plan=plan,
        records={c.layer: by_id[c.version.version_id] for c in plan.choices},
        skipped=skipped,
        overlays=overlays,
    )


def _recovery_point(layer_numel: Mapping[str, int], refs: Sequence[VersionRef], skipped: Collection[str]) -> int | None:
    """The newest recoverable step of the versions not in ``skipped`` (``None``: some layer has none)."""
    return newest_recoverable_step(list(layer_numel), [r for r in refs if r.version_id not in skipped])


def stored_at(store: LayerStore, layer_numel: Mapping[str, int], step: int) -> dict[str, Any]:
    """What the store holds of the run's state at ``step`` (the run's last step, at its end):
    the layers whose newest whole version is at that step, the others, and the newest
    recoverable step (what ``export`` and ``--resume`` get)."""
    refs = store.manifest().refs()
    newest: dict[str, int] = {}
    for ref in refs:
        if not ref.partial and ref.layer in layer_numel:
            newest[ref.layer] = max(newest.get(ref.layer, -1), ref.step)
    older = [layer for layer in layer_numel if newest.get(layer, -1) < step]
    return {
        "step": step,
        "layers": len(layer_numel),
        "layers_at_step": len(layer_numel) - len(older),
        "older": older,
        "newest_recoverable_step": newest_recoverable_step(list(layer_numel), refs),
    }


def _initial_records(store: LayerStore, layer_numel: Mapping[str, int]) -> list[VersionRecord]:
    """The placeholders of the layers whose step-0 state the run rebuilds (``initial.json``); none
    if it recorded none, or (logged) if that record is damaged."""
    try:
        initial = read_initial(store.fs)
    except ManifestError as error:
        logger.error("recovery: %s: planning without the initial state", error)
        return []
    return list(initial.records(layer_numel).values()) if initial is not None else []


def _problems(
    store: LayerStore,
    records: Sequence[VersionRecord],
    *,
    deep: bool,
    usable: dict[str, dict[str, list[Span]]],
    held: Collection[str] | None = None,
) -> dict[str, str]:
    """Why each unusable one of ``records`` is (by version id); each usable one joins ``usable``
    with the element spans it holds (a partial version's, from its record or its headers). A
    memory version has no files in storage: it is usable while the writers hold them (``held``).
    Every stored file is checked (:meth:`LayerStore.check_shard`) on :data:`CHECK_THREADS` threads:
    a plan checks every rank's file of every layer it chooses and of the captures overlaid on them,
    each a round trip to storage; one after another, that is 63,000 at 1,024 ranks and 31 layers."""
    problems: dict[str, str] = {}
    stored = []
    for record in records:
        if record.origin != MEMORY_ORIGIN:
            stored.append(record)
            continue
        gone = [s.path for s in record.shards if held is not None and s.path not in held]
        if gone:
            problems[record.version_id] = (
                f"the writers no longer hold {len(gone)} of its {len(record.shards)} files in memory"
            )
        else:
            usable[record.version_id] = {}
    files = [(record, entry) for record in stored for entry in record.shards]
    with ThreadPoolExecutor(max_workers=max(1, min(CHECK_THREADS, len(files)))) as pool:
        found = list(pool.map(lambda pair: store.check_shard(pair[0], pair[1], deep=deep), files))
    for (record, _), problem in zip(files, found, strict=True):
        if problem:
            problems[record.version_id] = "; ".join(filter(None, (problems.get(record.version_id), problem)))
    for record in stored:
        if record.version_id in problems:
            continue
        coverage: dict[str, list[Span]] = {}
        if record.partial:
            try:
                with VersionReader(store, record) as reader:
                    coverage = reader.coverage()
            except CorruptShardError as error:
                problems[record.version_id] = str(error)
                continue
        usable[record.version_id] = coverage
    return problems


def _meta_index(record: VersionRecord) -> int:
    """The first rank file of ``record`` that holds any element (by its recorded slices)."""
    return next((i for i, e in enumerate(record.shards) if e.slices and any(s.length for s in e.slices)), 0)


def files_for(records: Iterable[VersionRecord], needs: Mapping[str, Sequence[tuple[int, int]]]) -> list[str]:
    """The shard files of ``records`` that a rank restoring ``needs`` (param → element spans
    ``[start, end)``) opens with a :class:`VersionReader`: those holding any element it needs, and
    each version's metadata file; every file of a version whose record does not say which file
    holds what (its reader reads every header)."""
    paths: list[str] = []
    for record in records:
        if not all(entry.slices is not None for entry in record.shards):
            paths += [entry.path for entry in record.shards]
            continue
        meta = _meta_index(record)
        for index, entry in enumerate(record.shards):
            if index == meta or any(
                _overlaps(s.offset, s.offset + s.length, needs.get(s.name, ())) for s in entry.slices or ()
            ):
                paths.append(entry.path)
    return list(dict.fromkeys(paths))


def _overlaps(start: int, end: int, spans: Sequence[tuple[int, int]]) -> bool:
    return any(start < b and a < end for a, b in spans)


@dataclass(frozen=True)
class _Piece:
    offset: int
    length: int
    file_index: int


class VersionReader:
    """Reads exact ranges of one committed version. Open files and headers are cached; close
    it (or use ``with``) when done. Not thread-safe.

    Where the record says which elements each rank file holds (``ShardEntry.slices``), the reader
    opens only the files holding a range it reads, plus one file's header for the version's
    metadata (optimizer step, param groups): a rank restoring its own slices reads a file or two
    per version, not every rank's header (at N ranks, N headers per layer per rank, N² in all). A
    record without them (written before) has every header read first, to learn the same."""

    def __init__(self, store: LayerStore, record: VersionRecord) -> None:
        self.store = store
        self.record = record
        self._files: list[tensorfile.RandomAccess | None] = [None] * len(record.shards)
        self._headers: dict[int, tensorfile.ShardHeader] = {}
        self._index: dict[str, list[_Piece]] | None = None
        self._verified: set[tuple[int, str]] = set()
        self._sliced = all(entry.slices is not None for entry in record.shards)

    def __enter__(self) -> VersionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for i, file in enumerate(self._files):
            if file is not None:
                file.close()
                self._files[i] = None

    def _corrupt(self, index: int, reason: str) -> CorruptShardError:
        path = self.store.fs.uri(self.record.shards[index].path)
        return CorruptShardError(version_id=self.record.version_id, path=path, reason=reason)

    def _failed(self, index: int, error: Exception) -> OSError | CorruptShardError:
        """What a failed read of rank file ``index`` means: storage that did not answer or refused
        this process says nothing about the file (:class:`StoreUnavailableError`, never a reason to
        skip the version); any other failure makes the version corrupt."""
        if isinstance(error, OSError):
            unavailable = unavailable_error(self.store.fs.uri(self.record.shards[index].path), error)
            if unavailable is not None:
                return unavailable
        return self._corrupt(index, str(error))

    def _file(self, index: int) -> tensorfile.RandomAccess:
        file = self._files[index]
        if file is None:
            try:
                file = self._files[index] = self.store.open_file(self.record.shards[index].path)
            except FileNotFoundError as error:
                raise self._corrupt(index, "missing") from error
            except OSError as error:
                raise self._failed(index, error) from error
        return file

    def _header(self, index: int) -> tensorfile.ShardHeader:
        """Rank file ``index``'s header (read once), checked against the record and against the
        other headers read (one optimizer step)."""
        header = self._headers.get(index)
        if header is not None:
            return header
        entry = self.record.shards[index]
        file = self._file(index)
        try:
            header = tensorfile.read_header(file, path=self.store.fs.uri(entry.path))
        except (ShardFormatError, OSError) as error:
            raise self._failed(index, error) from error
        if header.checksum != entry.checksum or header.file_nbytes != entry.nbytes:
            raise self._corrupt(
                index,
                f"header checksum {header.checksum} / {header.file_nbytes} bytes, "
                f"the manifest says {entry.checksum} / {entry.nbytes} bytes",
            )
        if entry.slices is not None and tuple(header.slices) != entry.slices:
            raise self._corrupt(index, f"header slices {list(header.slices)}, the manifest says {list(entry.slices)}")
        steps = {h.optimizer_step for h in self._headers.values()} | {header.optimizer_step}
        if len(steps) != 1:
            raise self._corrupt(index, f"ranks disagree on the optimizer step: {sorted(steps)}")
        self._headers[index] = header
        return header

    def _slices(self, index: int) -> tuple[ParamSlice, ...]:
        entry_slices = self.record.shards[index].slices
        return entry_slices if self._sliced and entry_slices is not None else tuple(self._header(index).slices)

    def _pieces(self) -> dict[str, list[_Piece]]:
        """param → the files holding its elements, by offset (from the record, else every header)."""
        if self._index is None:
            index: dict[str, list[_Piece]] = {}
            for i in range(len(self.record.shards)):
                for piece in self._slices(i):
                    index.setdefault(piece.name, []).append(_Piece(piece.offset, piece.length, i))
            for pieces in index.values():
                pieces.sort(key=lambda p: (p.offset, -p.length))
            self._index = index
        return self._index

    def headers(self) -> list[tensorfile.ShardHeader]:
        """Every rank file's header (read once), checked against the record."""
        return [self._header(i) for i in range(len(self.record.shards))]

    def _meta_header(self) -> tensorfile.ShardHeader:
        """The header the version's metadata is read from: the first file that holds any element
        (the same one on every rank: :func:`files_for` names it)."""
        return self._header(_meta_index(self.record) if self._sliced else 0)

    def coverage(self) -> dict[str, list[Span]]:
        """param → the element spans ``[start, end)`` this version's files hold."""
        return {param: [(p.offset, p.offset + p.length) for p in pieces] for param, pieces in self._pieces().items()}

    @property
    def optimizer_step(self) -> int:
        return self._meta_header().optimizer_step

    @property
    def groups(self) -> tuple[dict[str, Any], ...]:
        """The layer's optimizer param-group hyper-parameters, as saved (every rank file holds them)."""
        return self._meta_header().groups

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: s.shape for i in range(len(self.record.shards)) for s in self._slices(i)}

    def _read_piece(self, piece: _Piece, key: str, param: str, start: int, count: int) -> np.ndarray:
        header = self._header(piece.file_index)
        entry = header.entries[tensorfile.entry_name(key, param)]
        file = self._file(piece.file_index)
        # a copy from memory was checked whole when fetched (memory_reads.ShardFile.verified)
        verify = (piece.file_index, entry.name) not in self._verified and not getattr(file, "verified", False)
        try:
            data = tensorfile.read_entry(
                file,
                entry,
                path=self.store.fs.uri(self.record.shards[piece.file_index].path),
                start=start,
                count=count,
                verify=verify,
            )
        except (ShardFormatError, OSError) as error:
            raise self._failed(piece.file_index, error) from error
        self._verified.add((piece.file_index, entry.name))
        return data

    def read(self, param: str, key: str, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of flattened parameter ``param``'s state
        ``key`` (``fp32``, ``exp_avg`` or ``exp_avg_sq``), as a new 1-D float32 tensor."""
        if key not in STATE_KEYS:
            raise ValueError(f"state key must be one of {STATE_KEYS}, got {key!r}")
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got offset={offset}, length={length}")
        index = self._pieces()
        pieces = index.get(param)
        if pieces is None:
            raise KeyError(f"version {self.record.version_id} has no parameter {param!r}; it has {sorted(index)}")
        out = np.empty(length, dtype=np.float32)
        end, position = offset + length, offset
        for piece in pieces:
            if position >= end:
                break
            piece_end = piece.offset + piece.length
            if piece_end <= position:
                continue
            if piece.offset > position:
                break  # a gap: reported below
            stop = min(piece_end, end)
            out[position - offset : stop - offset] = self._read_piece(
                piece, key, param, position - piece.offset, stop - position
            )
            position = stop
        if position < end:
            raise ValueError(
                f"version {self.record.version_id}: no stored rank holds elements [{position}, {end}) of "
                f"{param!r} (asked for [{offset}, {end}))"
            )
        import torch  # see the module's imports

        return torch.from_numpy(out)

    def read_slice(self, piece: ParamSlice, key: str) -> torch.Tensor:
        return self.read(piece.name, key, piece.offset, piece.length)
