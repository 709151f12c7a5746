"""Errors of the layer store. Each names the path (or version) and the cause."""

from __future__ import annotations


class StoreWriteError(OSError):
    """A write to the store failed (read-only, full, unreachable…). Nothing committed is lost:
    a failed write leaves at most an uncommitted temporary or orphan file that GC collects."""


class StoreUnavailableError(OSError):
    """The storage did not answer (a network failure, a timeout, throttling, a server error) while
    LayerCheck read or listed it: nothing about the store's contents follows from it. A record or
    shard that could not be read is not damaged, so readers raise this instead of planning around
    it; the caller reports it or tries again once the storage answers."""


class StoreAccessError(StoreUnavailableError):
    """The storage refused this process's credentials or permissions (access denied, a signature
    or key it does not accept, an expired token): the message names the store and the cause."""


class ShardFormatError(ValueError):
    """A shard file is not a well-formed LayerCheck safetensors file (or does not match the
    version record that names it)."""


class CorruptShardError(RuntimeError):
    """A shard of a committed version is missing, truncated or fails its checksum: the version
    is unusable and recovery must skip it."""

    def __init__(self, *, version_id: str, path: str, reason: str) -> None:
        super().__init__(f"version {version_id}: shard {path} is unusable: {reason}")
        self.version_id = version_id
        self.path = path
        self.reason = reason

    def __reduce__(self):  # keyword-only __init__: tell pickle (Ray ships errors between processes)
        return _rebuild_corrupt_shard_error, (self.version_id, self.path, self.reason)


def _rebuild_corrupt_shard_error(version_id: str, path: str, reason: str) -> CorruptShardError:
    return CorruptShardError(version_id=version_id, path=path, reason=reason)


class ManifestError(ValueError):
    """A commit record is malformed, or a commit request is inconsistent."""


class UnsafeStoreError(ValueError):
    """A storage location that LayerCheck refuses to use or to clear (the filesystem root, the
    home or working directory, a directory holding files LayerCheck did not write)."""


class PathOutsideStoreError(UnsafeStoreError):
    """A path that would leave the store's root (absolute, with a ``..`` component, or through a
    symbolic link that points outside it): never read, written or deleted. A commit record that
    names one is damaged."""


class StoreBusyError(RuntimeError):
    """Another process owns the store (its lease is live): two runs must not write one store."""


class LeaseLostError(StoreBusyError):
    """The store's lease now belongs to another run (or to nobody): this run must not write it."""


class LeaseLapsedError(LeaseLostError):
    """The run's lease on the store expired without a renewal reaching the store: another run may
    take the store over from then on, so this run writes and commits nothing more."""
