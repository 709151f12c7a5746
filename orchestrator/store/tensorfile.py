"""A LayerShard as a safetensors file, written and range-read over pyarrow streams.

The file is plain safetensors — ``u64-LE header length`` + JSON header + raw bytes — so the
official ``safetensors.safe_open`` reads it, but it is written here so that:

* the three flat state buffers of a :class:`~layercheck.workers.shard.LayerShard` go to the stream
  zero-copy, in order, with one tensor entry per (state key, parameter slice) pointing into
  them (entry ``"{key}/{param}"``, 1-D F32 of the slice's length);
* a reader fetches only the byte range of the entries it needs (one random-access read each:
  a ranged GET on object stores), which is what re-slicing at another world size needs.

Integrity without reading the whole file: the header's ``__metadata__`` holds a crc32 of every
tensor entry, and the version record holds the crc32 of the header block. Header checksum +
entry checksums + file size cover every byte, and one entry can be verified on its own.
No pickle anywhere: the metadata is JSON.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from layercheck.orchestrator.store.errors import ShardFormatError
from layercheck.workers.shard import STATE_KEYS, LayerShard, ParamSlice

FORMAT = "layercheck.shard/1"
_DTYPE = "F32"
_ITEM = 4
_MAX_HEADER = 64 << 20
#: Shard files held in memory from this size up get a mapping of their own (:func:`file_buffer`).
OWN_MAPPING_MIN = 1 << 20


def format_checksum(value: int) -> str:
    return f"crc32:{value & 0xFFFFFFFF:08x}"


def entry_name(key: str, param: str) -> str:
    return f"{key}/{param}"


class RandomAccess(Protocol):
    """What a shard file is read through: a ``pyarrow`` input file, or a recovery's
    ``ShardFile`` (``orchestrator/core/memory/reads.py``)."""

    def size(self) -> int: ...

    def read_at(self, nbytes: int, offset: int) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class FileDigest:
    """What a writer learns about the file it wrote: its size and checksum (of the header block,
    which holds the checksum of every tensor entry)."""

    nbytes: int
    checksum: str


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One tensor of the file: absolute byte range and its checksum."""

    name: str
    offset: int
    length: int
    checksum: str

    @property
    def nbytes(self) -> int:
        return self.length * _ITEM


@dataclass(frozen=True, kw_only=True)
class ShardHeader:
    """The parsed header of one shard file."""

    layer: str
    step: int
    rank: int
    world_size: int
    base: bool
    optimizer_step: int
    groups: tuple[dict[str, Any], ...]
    slices: tuple[ParamSlice, ...]
    entries: Mapping[str, Entry]
    checksum: str
    file_nbytes: int


def _flat_bytes(shard: LayerShard, key: str) -> memoryview:
    tensor = shard.tensors[key].detach()
    if tensor.device.type != "cpu":
        raise ValueError(f"layer {shard.layer!r} state {key!r} is on {tensor.device}; copy it to host memory first")
    # .data: the array's buffer as a memoryview (numpy types memoryview(array) only for Python 3.12+)
    return tensor.contiguous().numpy().data.cast("B")


def _header_block(shard: LayerShard, *, base: bool, buffers: Mapping[str, memoryview]) -> bytes:
    names = [s.name for s in shard.slices]
    if len(set(names)) != len(names):
        raise ValueError(f"layer {shard.layer!r} shard lists a parameter twice: {names}")
    tensors: dict[str, Any] = {}
    checksums: dict[str, str] = {}
    position = 0
    for key in STATE_KEYS:
        start = 0
        for piece in shard.slices:
            name = entry_name(key, piece.name)
            a, b = (start * _ITEM, (start + piece.length) * _ITEM)
            tensors[name] = {"dtype": _DTYPE, "shape": [piece.length], "data_offsets": [position + a, position + b]}
            checksums[name] = format_checksum(zlib.crc32(buffers[key][a:b]))
            start += piece.length
        position += len(buffers[key])
    try:
        groups = json.dumps(list(shard.groups))
    except TypeError as error:
        raise ValueError(f"layer {shard.layer!r}: param-group hyper-parameters are not JSON-safe: {error}") from error
    slices = [{"name": s.name, "shape": list(s.shape), "offset": s.offset, "length": s.length} for s in shard.slices]
    tensors["__metadata__"] = {
        "format": FORMAT,
        "layer": shard.layer,
        "step": str(shard.step),
        "rank": str(shard.rank),
        "world_size": str(shard.world_size),
        "base": "true" if base else "false",
        "optimizer_step": str(shard.optimizer_step),
        "groups": groups,
        "slices": json.dumps(slices),
        "checksums": json.dumps(checksums),
    }
    header = json.dumps(tensors, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # keeps the tensor data 8-byte aligned
    return struct.pack("<Q", len(header)) + header


def write_shard(
    stream: pa.NativeFile,
    shard: LayerShard,
    *,
    base: bool = False,
    after_header: Callable[[], None] | None = None,
) -> FileDigest:
    """Write ``shard`` to ``stream``: the header, then its three flat buffers without copying."""
    buffers, block = _file_parts(shard, base=base)
    return _stream(stream, block, buffers, after_header=after_header)


@dataclass(frozen=True, kw_only=True)
class EncodedShard:
    """A shard file serialised in memory: written to storage as is, and kept by the in-memory
    tier of recovery (``orchestrator/core/memory/tier.py``)."""

    data: pa.Buffer
    digest: FileDigest
    header_nbytes: int
    """Where the tensor data begins (a write's ``partial`` point)."""


def encode_shard(shard: LayerShard, *, base: bool = False) -> EncodedShard:
    """``shard`` as the bytes :func:`write_shard` would write: one copy of its state, in a buffer
    of exactly the file's size (:func:`file_buffer`)."""
    buffers, block = _file_parts(shard, base=base)
    data = file_buffer(len(block) + sum(len(b) for b in buffers.values()))
    digest = _stream(pa.FixedSizeBufferWriter(data), block, buffers)
    return EncodedShard(data=data, digest=digest, header_nbytes=len(block))


def file_buffer(nbytes: int) -> pa.Buffer:
    """A writable buffer of ``nbytes`` for a shard file held in memory. From
    :data:`OWN_MAPPING_MIN` bytes up, a private anonymous mapping of its own, unmapped as soon as
    the last view of it goes: a writer's resident memory then is what its in-memory tier counts
    (``persistence.memory_bytes``). Through pyarrow's pool (mimalloc) freed files stayed resident:
    a writer holding 1.49 GiB of a 135M model's memory versions had 509 MiB more than it held
    (``bench/probes/writer_memory.py``), and a growing ``pa.BufferOutputStream`` had reserved up to
    1.5x each file's size. Smaller files come from the pool (a page each would waste more)."""
    if nbytes < OWN_MAPPING_MIN:
        return pa.allocate_buffer(nbytes)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)  # populated: no fault per page
    try:
        return pa.py_buffer(mmap.mmap(-1, nbytes, flags=flags))
    except OSError:  # out of mappings (vm.max_map_count): the pool still holds it, only less tightly
        return pa.allocate_buffer(nbytes)


def _file_parts(shard: LayerShard, *, base: bool) -> tuple[dict[str, memoryview], bytes]:
    """The shard's three flat state buffers (views, no copy) and its header block."""
    if sys.byteorder != "little":
        raise RuntimeError("the shard format is little-endian; big-endian hosts are not supported")
    buffers = {key: _flat_bytes(shard, key) for key in STATE_KEYS}
    return buffers, _header_block(shard, base=base, buffers=buffers)


def _stream(
    stream: pa.NativeFile,
    block: bytes,
    buffers: Mapping[str, memoryview],
    *,
    after_header: Callable[[], None] | None = None,
) -> FileDigest:
    stream.write(block)
    if after_header is not None:
        after_header()
    for key in STATE_KEYS:
        stream.write(buffers[key])
    nbytes = len(block) + sum(len(b) for b in buffers.values())
    return FileDigest(nbytes=nbytes, checksum=format_checksum(zlib.crc32(block)))


def _meta_int(meta: Mapping[str, str], field: str, path: str) -> int:
    try:
        return int(meta[field])
    except (KeyError, ValueError) as error:
        raise ShardFormatError(f"{path}: header metadata field {field!r} is missing or not an integer") from error


def _parse_entries(
    raw: Mapping[str, Any], checksums: Mapping[str, str], data_start: int, data_nbytes: int, path: str
) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    spans = []
    for name, spec in raw.items():
        if name == "__metadata__":
            continue
        try:
            a, b = (int(x) for x in spec["data_offsets"])
            (length,) = spec["shape"]
            dtype = spec["dtype"]
        except (KeyError, TypeError, ValueError) as error:
            raise ShardFormatError(f"{path}: tensor {name!r} has a malformed header entry") from error
        if dtype != _DTYPE or b - a != int(length) * _ITEM or name not in checksums:
            raise ShardFormatError(f"{path}: tensor {name!r} is not a checksummed 1-D F32 entry")
        entries[name] = Entry(name=name, offset=data_start + a, length=int(length), checksum=checksums[name])
        spans.append((a, b))
    end = 0
    for a, b in sorted(spans):
        if a != end:
            raise ShardFormatError(f"{path}: tensor data is not contiguous at byte {a} of the data section")
        end = b
    if end != data_nbytes:
        raise ShardFormatError(
            f"{path}: the tensors need {end} data bytes but the file has {data_nbytes} (truncated or padded)"
        )
    return entries


def read_header(file: RandomAccess, *, path: str) -> ShardHeader:
    """Parse and check the header of a shard file (one small read, plus the file size)."""
    size = file.size()
    if size < 8:
        raise ShardFormatError(f"{path}: {size} bytes is too short for a safetensors file (truncated)")
    prefix = bytes(file.read_at(8, 0))
    (n,) = struct.unpack("<Q", prefix)
    if n > min(size - 8, _MAX_HEADER):
        raise ShardFormatError(f"{path}: header length {n} exceeds the file ({size} bytes): truncated or corrupt")
    body = file.read_at(n, 8)
    body = body if isinstance(body, bytes) else bytes(body)  # (a zero-copy buffer of a file held in memory)
    try:
        raw = json.loads(body)
        meta = raw["__metadata__"]
        checksums = json.loads(meta["checksums"])
        groups = tuple(json.loads(meta["groups"]))
        slices = tuple(
            ParamSlice(name=s["name"], shape=tuple(s["shape"]), offset=int(s["offset"]), length=int(s["length"]))
            for s in json.loads(meta["slices"])
        )
    except (ValueError, KeyError, TypeError) as error:
        raise ShardFormatError(f"{path}: header is not LayerCheck safetensors JSON ({error})") from error
    if meta.get("format") != FORMAT:
        raise ShardFormatError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    entries = _parse_entries(raw, checksums, 8 + n, size - 8 - n, path)
    for key in STATE_KEYS:
        for piece in slices:
            entry = entries.get(entry_name(key, piece.name))
            if entry is None or entry.length != piece.length:
                raise ShardFormatError(f"{path}: no {piece.length}-element tensor for {entry_name(key, piece.name)!r}")
    return ShardHeader(
        layer=str(meta.get("layer", "")),
        step=_meta_int(meta, "step", path),
        rank=_meta_int(meta, "rank", path),
        world_size=_meta_int(meta, "world_size", path),
        base=meta.get("base") == "true",
        optimizer_step=_meta_int(meta, "optimizer_step", path),
        groups=groups,
        slices=slices,
        entries=entries,
        checksum=format_checksum(zlib.crc32(body, zlib.crc32(prefix))),
        file_nbytes=size,
    )


def read_entry(
    file: RandomAccess, entry: Entry, *, path: str, start: int = 0, count: int | None = None, verify: bool = True
) -> np.ndarray:
    """Elements ``[start, start + count)`` of ``entry`` as float32. With ``verify`` the whole
    entry is read and checked against its checksum; without, only the requested bytes."""
    count = entry.length - start if count is None else count
    if start < 0 or count < 0 or start + count > entry.length:
        raise ValueError(f"{path}: range [{start}, {start + count}) is outside tensor {entry.name!r} of {entry.length}")
    if verify:
        raw = file.read_at(entry.nbytes, entry.offset)
        if len(raw) != entry.nbytes:
            raise ShardFormatError(f"{path}: tensor {entry.name!r} is truncated")
        if format_checksum(zlib.crc32(raw)) != entry.checksum:
            raise ShardFormatError(f"{path}: tensor {entry.name!r} fails its checksum ({entry.checksum})")
        return np.frombuffer(raw, dtype="<f4")[start : start + count]
    raw = file.read_at(count * _ITEM, entry.offset + start * _ITEM)
    if len(raw) != count * _ITEM:
        raise ShardFormatError(f"{path}: tensor {entry.name!r} is truncated")
    return np.frombuffer(raw, dtype="<f4")


def load_shard(file: RandomAccess, *, path: str) -> LayerShard:
    """The whole file back as a :class:`LayerShard` (every entry verified)."""
    import torch  # here only: the store's readers of headers and ranges (the supervisor, the writers) go without it

    header = read_header(file, path=path)
    tensors = {}
    for key in STATE_KEYS:
        parts = [read_entry(file, header.entries[entry_name(key, s.name)], path=path) for s in header.slices]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
        tensors[key] = torch.from_numpy(flat.astype(np.float32, copy=True))
    return LayerShard(
        layer=header.layer,
        step=header.step,
        rank=header.rank,
        world_size=header.world_size,
        slices=header.slices,
        tensors=tensors,
        optimizer_step=header.optimizer_step,
        groups=header.groups,
    )
