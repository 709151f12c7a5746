"""Store requests, counted: a ``pyarrow.fs`` wrapper that counts each call the store makes on its
filesystem, by kind, in every process of the harness.

The harness installs it with Ray's ``worker_process_setup_hook`` (:func:`install`), so the
supervisor, the writer actors and the rank hosts open the run's store through it without a
change to the product: :func:`install` wraps what ``StoreFS.open`` gets from ``open_uri``. A
loopback S3 server at these request rates would measure itself; the counts say what an object
store would be asked. Kinds: ``put`` (a file written), ``get`` (a file opened for reading),
``head`` (one path's info), ``list`` (a directory listed), ``delete``, ``move`` (an atomic rename:
on an object store the write goes straight to its name instead), ``mkdir`` (no request on an object
store's flat namespace, but pyarrow's S3 client checks the parent)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pyarrow.fs as pafs

from layercheck.orchestrator.store import fs as store_fs
from layercheck.orchestrator.store.uri import OpenedURI

KINDS = ("put", "get", "head", "list", "delete", "move", "mkdir")

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def _count(kind: str, n: int = 1) -> None:
    with _lock:
        _counts[kind] += n


def snapshot() -> dict[str, int]:
    """This process's counts so far, every kind present."""
    with _lock:
        return {kind: _counts.get(kind, 0) for kind in KINDS}


def reset() -> None:
    with _lock:
        _counts.clear()


class CountingHandler(pafs.FileSystemHandler):
    """Every call to the inner filesystem, counted by kind (see the module)."""

    def __init__(self, inner: pafs.FileSystem) -> None:
        self.inner = inner

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountingHandler) and self.inner.equals(other.inner)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return f"counting+{self.inner.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        _count("head", len(paths))
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        _count("list")
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        _count("mkdir")
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        _count("delete")
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        _count("delete")
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        _count("delete")
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        _count("delete")
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        _count("move")
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        _count("put")
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        _count("get")
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        _count("get")
        return self.inner.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        _count("put")
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        _count("put")
        return self.inner.open_append_stream(path, metadata=metadata)


def counting_open_uri(uri: str) -> OpenedURI:
    """``open_uri`` whose filesystem counts its requests."""
    opened = _ORIGINAL["open_uri"](uri)
    return OpenedURI(fs=pafs.PyFileSystem(CountingHandler(opened.fs)), root=opened.root, query=opened.query)


_ORIGINAL: dict[str, Any] = {}


def install() -> None:
    """Count every store this process opens from now on (Ray's ``worker_process_setup_hook``)."""
    if "open_uri" not in _ORIGINAL:
        _ORIGINAL["open_uri"] = store_fs.open_uri
        store_fs.open_uri = counting_open_uri


def uninstall() -> None:
    """Open stores as the product does again (the harness's own process, when it ends)."""
    if "open_uri" in _ORIGINAL:
        store_fs.open_uri = _ORIGINAL.pop("open_uri")


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {kind: after.get(kind, 0) - before.get(kind, 0) for kind in KINDS}
