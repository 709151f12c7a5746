"""The run directory as a whole: is it a safe place for a run, and clearing what LayerCheck
wrote there (``layercheck train --overwrite``).

An overwrite deletes only what LayerCheck writes (``STORE_LAYOUT.md``): ``layers/`` with shard
files, ``manifest/`` with commit records, the run files in the root (``run.json``,
``drift_trace.json``, the owner lease) and the temporaries of their atomic writes. Any other
file in the directory means it is not only a LayerCheck run: the overwrite is refused and
nothing is deleted. A store at ``/``, the home directory, the working directory or one of its
parents (``storage = ""`` or ``"."``) is refused outright: a mistyped path must not turn a
source tree into a run directory, nor an overwrite into ``rm -r``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from layercheck.orchestrator.store.epochs import EPOCHS_DIR
from layercheck.orchestrator.store.errors import UnsafeStoreError
from layercheck.orchestrator.store.fs import OBJECT_STORES, StoreFS
from layercheck.orchestrator.store.initial_state import INITIAL_FILE
from layercheck.orchestrator.store.layer_store import DRIFT_TRACE_FILE, PREVIOUS_RUN_CONFIG_FILE, RUN_CONFIG_FILE
from layercheck.orchestrator.store.lease import LEASE_FILE
from layercheck.orchestrator.store.manifest import LAYERS_DIR, MANIFEST_DIR
from layercheck.orchestrator.store.model_record import MODEL_FILE

logger = logging.getLogger(__name__)

#: Files LayerCheck writes in the root of a run (besides ``layers/`` and ``manifest/``).
#: A new run file must be added here, or ``--overwrite`` refuses the directory it is in.
RUN_ROOT_FILES: frozenset[str] = frozenset(
    {RUN_CONFIG_FILE, PREVIOUS_RUN_CONFIG_FILE, DRIFT_TRACE_FILE, LEASE_FILE, INITIAL_FILE, MODEL_FILE}
)

_TMP = r"(\.[0-9a-f]{8}\.tmp)?"
_SHARD_FILE = re.compile(
    r"^[A-Za-z0-9_.\-]+/\d{10}(-base)?(-capture)?-rank\d{5}of\d{5}-[0-9a-f]{8}\.safetensors" + _TMP + "$"
)
_RECORD_FILE = re.compile(r"^[A-Za-z0-9_.\-]+@\d{10}(-base)?(-partial)?-[0-9a-f]{8}\.json" + _TMP + "$")
_EPOCH_FILE = re.compile(r"^\d{10}\.json" + _TMP + "$")
_MAX_NAMED = 5


@dataclass(frozen=True, kw_only=True)
class RunDirContents:
    """What is in a run directory, sorted into what LayerCheck wrote and what it did not."""

    owned: tuple[str, ...]
    """Relative paths of files LayerCheck wrote (shards, records, run files, their temporaries)."""
    foreign: tuple[str, ...]
    """Relative paths of everything else (files, and directories LayerCheck never makes)."""


def check_run_location(fs: StoreFS, *, cwd: str | None = None, home: str | None = None) -> None:
    """Raise :class:`UnsafeStoreError` if ``fs`` is no place for a run (see :func:`location_problem`)."""
    problem = location_problem(
        fs.fs.type_name, fs.root, uri=fs.uri(), cwd=cwd or os.getcwd(), home=home or os.path.expanduser("~")
    )
    if problem:
        raise UnsafeStoreError(problem)


def location_problem(kind: str, root: str, *, uri: str, cwd: str, home: str) -> str:
    """Why a run must not live at ``root`` of a ``kind`` filesystem ("" if it may): the filesystem
    root, the home directory, the working directory or a parent of either, an object-store bucket root."""
    if kind in OBJECT_STORES:
        if "/" not in root.strip("/"):
            where, query = uri.partition("?")[::2]
            example = f"{where.rstrip('/')}/runs/NAME" + (f"?{query}" if query else "")
            return f"storage {uri} is a bucket root; give the run a prefix of its own (e.g. {example})"
        return ""
    if kind != "local":
        return ""
    path, cwd, home = os.path.realpath(root), os.path.realpath(cwd), os.path.realpath(home)
    reasons = {
        os.path.realpath(os.sep): "the filesystem root",
        home: "your home directory",
        cwd: "the working directory (did storage come out empty or '.'?)",
    }
    if path in reasons:
        return f'storage {path} is {reasons[path]}; a run needs a directory of its own, e.g. storage = "runs/{{name}}"'
    for inner, what in ((cwd, "the working directory"), (home, "your home directory")):
        if inner.startswith(path.rstrip(os.sep) + os.sep):
            return (
                f"storage {path} contains {what} ({inner}); a run needs a directory of its own, "
                'e.g. storage = "runs/{name}"'
            )
    return ""


def _root_name(rel: str) -> str:
    match = re.match(r"^(.*)\.[0-9a-f]{8}\.tmp$", rel)
    return match.group(1) if match else rel


def run_dir_contents(fs: StoreFS) -> RunDirContents:
    """Every file under the run directory, sorted into owned and foreign; directories other
    than ``layers/``, ``layers/<layer>/`` and ``manifest/`` count as foreign too."""
    selector = pafs.FileSelector(fs.root, allow_not_found=True, recursive=True)
    prefix = fs.root.rstrip("/") + "/"
    owned, foreign = [], []
    for info in fs.fs.get_file_info(selector):
        rel = info.path[len(prefix) :] if info.path.startswith(prefix) else info.path
        if info.type == pafs.FileType.Directory:
            parts = rel.split("/")
            if not (rel in (LAYERS_DIR, MANIFEST_DIR, EPOCHS_DIR) or (len(parts) == 2 and parts[0] == LAYERS_DIR)):
                foreign.append(rel + "/")
        elif _owned_file(rel):
            owned.append(rel)
        else:
            foreign.append(rel)
    return RunDirContents(owned=tuple(sorted(owned)), foreign=tuple(sorted(foreign)))


def _owned_file(rel: str) -> bool:
    if rel.startswith(LAYERS_DIR + "/"):
        return bool(_SHARD_FILE.match(rel[len(LAYERS_DIR) + 1 :]))
    if rel.startswith(MANIFEST_DIR + "/"):
        return bool(_RECORD_FILE.match(rel[len(MANIFEST_DIR) + 1 :]))
    if rel.startswith(EPOCHS_DIR + "/"):
        return bool(_EPOCH_FILE.match(rel[len(EPOCHS_DIR) + 1 :]))
    return "/" not in rel and _root_name(rel) in RUN_ROOT_FILES


def clear_run(fs: StoreFS, *, keep: frozenset[str] = frozenset()) -> int:
    """Delete every file LayerCheck wrote in the run directory (but ``keep``, e.g. the lease of
    the run that is clearing it, and the epochs, which are never deleted: a new run's epoch must
    stay newer than any earlier owner's) and the then-empty ``layers/`` and ``manifest/``; returns the
    number of files deleted. Refuses (:class:`UnsafeStoreError`, nothing deleted) a location
    :func:`check_run_location` rejects or a directory holding anything LayerCheck did not write."""
    check_run_location(fs)
    contents = run_dir_contents(fs)
    if contents.foreign:
        named = ", ".join(contents.foreign[:_MAX_NAMED])
        more = f" and {len(contents.foreign) - _MAX_NAMED} more" if len(contents.foreign) > _MAX_NAMED else ""
        raise UnsafeStoreError(
            f"--overwrite refused: {fs.uri()} holds files LayerCheck did not write ({named}{more}); nothing "
            "was deleted. Point storage at a directory of its own, or move those files away."
        )
    doomed = [rel for rel in contents.owned if rel not in keep and not rel.startswith(EPOCHS_DIR + "/")]
    for rel in doomed:
        fs.delete(rel)
    for rel in (LAYERS_DIR, MANIFEST_DIR):
        try:
            fs.fs.delete_dir(fs.path(rel))
        except FileNotFoundError:
            pass
    logger.warning("--overwrite: deleted %d file(s) an earlier run left in %s", len(doomed), fs.uri())
    return len(doomed)
