"""Helpers for the layer-store tests: shards of a known layer state, cut at any world size, and
a wrapped local filesystem that fails on demand (read-only, disk full)."""

from __future__ import annotations

import errno
import json
import math
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import torch

from layercheck.orchestrator.store.fs import StoreFS
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.lease import LEASE_FILE, LeaseInfo
from layercheck.orchestrator.store.manifest import ShardReceipt, VersionRecord, record_path
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

PARAMS: dict[str, tuple[int, ...]] = {"w": (6, 5), "b": (5,), "g": (7,)}


def layer_state(params: Mapping[str, tuple[int, ...]], *, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """``state[key][param]``: the full flattened tensor of each parameter, distinct per seed."""
    gen = torch.Generator().manual_seed(seed)
    return {
        key: {name: torch.randn(math.prod(shape), generator=gen) for name, shape in params.items()}
        for key in STATE_KEYS
    }


def even_cuts(total: int, world_size: int) -> list[int]:
    return [total * r // world_size for r in range(world_size + 1)]


def cut_shards(
    layer: str,
    step: int,
    params: Mapping[str, tuple[int, ...]],
    state: Mapping[str, Mapping[str, torch.Tensor]],
    cuts: Sequence[int],
    *,
    optimizer_step: int | None = None,
) -> list[LayerShard]:
    """ZeRO-1/2 style: the layer's parameters flattened end to end, rank ``r`` holding
    ``[cuts[r], cuts[r+1])`` of that — so a rank holds pieces of one or several parameters."""
    world_size = len(cuts) - 1
    starts, position = {}, 0
    for name, shape in params.items():
        starts[name] = position
        position += math.prod(shape)
    shards = []
    for rank in range(world_size):
        lo, hi = cuts[rank], cuts[rank + 1]
        slices = []
        for name, shape in params.items():
            a, b = max(lo, starts[name]), min(hi, starts[name] + math.prod(shape))
            if a < b:
                slices.append(ParamSlice(name=name, shape=shape, offset=a - starts[name], length=b - a))
        tensors = {
            key: torch.cat([state[key][s.name][s.offset : s.offset + s.length] for s in slices])
            if slices
            else torch.zeros(0)
            for key in STATE_KEYS
        }
        shards.append(
            LayerShard(
                layer=layer,
                step=step,
                rank=rank,
                world_size=world_size,
                slices=tuple(slices),
                tensors=tensors,
                optimizer_step=step if optimizer_step is None else optimizer_step,
                groups=({"name": f"{layer}.decay", "lr": 1e-5, "betas": [0.9, 0.999], "params": sorted(params)},),
            )
        )
    return shards


def seed_of(layer: str, step: int) -> int:
    return zlib.crc32(f"{layer}@{step}".encode())


def write_layer(
    store: LayerStore,
    layer: str,
    step: int,
    *,
    world_size: int = 2,
    seed: int | None = None,
    base: bool = False,
    params: Mapping[str, tuple[int, ...]] = PARAMS,
):
    """Write and commit one version; returns (record, state)."""
    state = layer_state(params, seed=seed_of(layer, step) if seed is None else seed)
    total = sum(math.prod(s) for s in params.values())
    record = store.write_version(cut_shards(layer, step, params, state, even_cuts(total, world_size)), base=base)
    return record, state


def newest_steps(store: LayerStore | str) -> dict[str, int]:
    """Each layer's newest committed step in ``store`` (a store or its URI)."""
    store = LayerStore.open(store) if isinstance(store, str) else store
    newest: dict[str, int] = {}
    for version in store.versions():
        newest[version.layer] = max(version.step, newest.get(version.layer, 0))
    return newest


def written_receipts(store: LayerStore, layer: str, step: int, *, world_size: int = 2) -> list[ShardReceipt]:
    """Every rank's shard of ``layer`` at ``step`` (the default ``PARAMS``) written, not committed;
    their receipts."""
    total = sum(math.prod(s) for s in PARAMS.values())
    state = layer_state(PARAMS, seed=step)
    return [store.write_shard(s) for s in cut_shards(layer, step, PARAMS, state, even_cuts(total, world_size))]


def receipt(layer: str, step: int, rank: int, world_size: int = 2) -> ShardReceipt:
    """A receipt for a shard nobody wrote (for the commit bookkeeping, which never reads files)."""
    return ShardReceipt(
        layer=layer,
        step=step,
        rank=rank,
        world_size=world_size,
        base=False,
        path=f"layers/{layer}/{step}-{rank}",
        nbytes=10,
        checksum="0",
    )


def foreign_lease(fs: StoreFS, *, expires_in: float = 600.0, host: str = "other-host", pid: int = 4242) -> LeaseInfo:
    """Another run's lease on ``fs`` (run ``other``, owner ``f00d``), live for ``expires_in`` seconds."""
    now = time.time()
    info = LeaseInfo(owner="f00d", host=host, pid=pid, run="other", acquired_at=now - 5, expires_at=now + expires_in)
    fs.write_bytes(LEASE_FILE, json.dumps(info.to_json()).encode())
    return info


class _FailingWriter:
    """A writable file object that raises ``error`` once more than ``limit`` bytes were written."""

    def __init__(self, inner: pa.NativeFile, limit: int, error: OSError) -> None:
        self.inner, self.limit, self.error, self.written, self.closed = inner, limit, error, 0, False

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self.written + size > self.limit:
            raise self.error
        self.written += size
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def writable(self) -> bool:
        return True


class FaultyLocalFS(pafs.FileSystemHandler):
    """A local filesystem that can be made read-only (every write raises PermissionError) or
    full (writes raise ENOSPC after ``space_left`` more bytes) — root ignores chmod, this does not."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()
        self.read_only = False
        self.space_left: int | None = None

    def _check_writable(self, path: str) -> None:
        if self.read_only:
            raise PermissionError(errno.EACCES, "Permission denied", path)

    def get_type_name(self):
        return "faulty"

    def normalize_path(self, path):
        return self.local.normalize_path(path)

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def open_input_stream(self, path):
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        return self.local.open_input_file(path)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def create_dir(self, path, recursive):
        self._check_writable(path)
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self._check_writable(path)
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._check_writable(path)
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise PermissionError(errno.EACCES, "refusing to delete the root")

    def delete_file(self, path):
        self._check_writable(path)
        self.local.delete_file(path)

    def move(self, src, dest):
        self._check_writable(dest)
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self._check_writable(dest)
        self.local.copy_file(src, dest)

    def open_output_stream(self, path, metadata):
        self._check_writable(path)
        inner = self.local.open_output_stream(path)
        if self.space_left is None:
            return inner
        error = OSError(errno.ENOSPC, "No space left on device", path)
        return pa.PythonFile(_FailingWriter(inner, self.space_left, error), mode="w")

    def open_append_stream(self, path, metadata):
        self._check_writable(path)
        return self.local.open_append_stream(path)


def faulty_store(root: str) -> tuple[LayerStore, FaultyLocalFS]:
    handler = FaultyLocalFS()
    return LayerStore(StoreFS(fs=pafs.PyFileSystem(handler), root=root)), handler


def flip_data_byte(store: LayerStore, record: VersionRecord, *, rank: int = 0) -> None:
    """Flip one byte near the end of rank ``rank``'s file of ``record``: in its tensor data (the
    last state buffer), so the header, its size and its checksum still match the record — only a
    read of that tensor finds it."""
    path = Path(store.fs.path(record.shards[rank].path))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))


def relabel_version(store: LayerStore, record: VersionRecord, step: int) -> VersionRecord:
    """``record`` renamed consistently to ``step``: its commit record (``version_id``, ``step``,
    shard paths) and its files' names, the files themselves untouched (their headers still hold
    the step they were taken at). The relabelled record."""
    old, new = f"{record.step:010d}", f"{step:010d}"
    shards = []
    for entry in record.shards:
        path = entry.path.replace(f"/{old}", f"/{new}", 1)
        Path(store.fs.path(entry.path)).rename(store.fs.path(path))
        shards.append(replace(entry, path=path))
    relabelled = replace(
        record, version_id=record.version_id.replace(f"@{old}", f"@{new}", 1), step=step, shards=tuple(shards)
    )
    manifest = Path(store.fs.path(record_path(record.version_id)))
    text = json.loads(manifest.read_text())
    text.update(
        version_id=relabelled.version_id,
        step=step,
        shards=[{**s, "path": e.path} for s, e in zip(text["shards"], shards, strict=True)],
    )
    Path(store.fs.path(record_path(relabelled.version_id))).write_text(json.dumps(text))
    manifest.unlink()
    return relabelled
