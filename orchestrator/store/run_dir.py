"""The run directory as a whole: is it a safe place for a run, which of its files LayerCheck
wrote (:func:`owned_file`: what ``--overwrite`` and ``layercheck gc`` may delete), and clearing
what LayerCheck wrote there (``layercheck train --overwrite``).

An overwrite deletes only what LayerCheck writes (``STORE_LAYOUT.md``): ``layers/`` with shard
files, ``manifest/`` with commit records, the run files in the root (``run.json``,
``drift_trace.json``, the owner lease), the tokenizer files of ``tokenizer/`` and the
temporaries of their atomic writes. Any other
file in the directory means it is not only a LayerCheck run: the overwrite is refused and
nothing is deleted. A store at ``/``, the home directory, the working directory or one of its
parents (``storage = ""`` or ``"."``) is refused outright: a mistyped path must not turn a
source tree into a run directory, nor an overwrite into ``rm -r``. So is a store inside another
run's directory, or one holding another run below it: each run's GC and overwrite work on its
whole tree, and the other run's files are not theirs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from layercheck.orchestrator.store.epochs import EPOCH_FILE, EPOCHS_DIR
from layercheck.orchestrator.store.errors import UnsafeStoreError
from layercheck.orchestrator.store.fs import OBJECT_STORES, TMP_PATTERN, StoreFS
from layercheck.orchestrator.store.initial_state import INITIAL_FILE
from layercheck.orchestrator.store.layer_store import (
    DRIFT_TRACE_FILE,
    PREVIOUS_RUN_CONFIG_FILE,
    RECORD_FILE,
    RUN_CONFIG_FILE,
    SHARD_FILE,
)
from layercheck.orchestrator.store.lease import LEASE_FILE
from layercheck.orchestrator.store.manifest import LAYER_NAME_PATTERN, LAYERS_DIR, MANIFEST_DIR
from layercheck.orchestrator.store.model_record import MODEL_FILE, TOKENIZER_DIR, TOKENIZER_FILE
from layercheck.orchestrator.store.unavailable import unavailable_error

logger = logging.getLogger(__name__)

#: Files LayerCheck writes in the root of a run (besides ``layers/`` and ``manifest/``).
#: A new run file must be added here, or ``--overwrite`` refuses the directory it is in.
RUN_ROOT_FILES: frozenset[str] = frozenset(
    {RUN_CONFIG_FILE, PREVIOUS_RUN_CONFIG_FILE, DRIFT_TRACE_FILE, LEASE_FILE, INITIAL_FILE, MODEL_FILE}
)

_ROOT_TMP = re.compile(rf"(.*){TMP_PATTERN}")
#: Directories LayerCheck makes: ``layers/``, ``layers/<layer>/``, ``manifest/``, ``epochs/``, ``tokenizer/``.
_OWN_DIR = re.compile(rf"{LAYERS_DIR}(/{LAYER_NAME_PATTERN})?|{MANIFEST_DIR}|{EPOCHS_DIR}|{TOKENIZER_DIR}")
_MAX_NAMED = 5


@dataclass(frozen=True, kw_only=True)
class RunDirContents:
    """What is in a run directory, sorted into what LayerCheck wrote and what it did not."""

    owned: tuple[str, ...]
    """Relative paths of files LayerCheck wrote (shards, records, run files, their temporaries)."""
    foreign: tuple[str, ...]
    """Relative paths of everything else (files, and directories LayerCheck never makes)."""


def check_run_location(fs: StoreFS, *, cwd: str | None = None, home: str | None = None) -> None:
    """Raise :class:`UnsafeStoreError` if ``fs`` is no place for a run (see :func:`location_problem`
    and :func:`nesting_problem`). Reads only: run before anything is written."""
    problem = location_problem(
        fs.fs.type_name, fs.root, uri=fs.uri(), cwd=cwd or os.getcwd(), home=home or os.path.expanduser("~")
    ) or nesting_problem(fs)
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


def nesting_problem(fs: StoreFS) -> str:
    """Why a run must not live at ``fs``'s root because of another LayerCheck run ("" if none):
    the root lies inside another run's directory, or holds one below it. A run's GC and
    ``--overwrite`` work on its whole tree; another run's files in it are not theirs to judge
    (a GC that took them for orphans once deleted a whole nested run)."""
    outer = _enclosing_run(fs)
    if outer is not None:
        where, why = outer
        beside = posixpath.dirname(where)  # a sibling of the outer run ("": it is a bucket)
        example = f", e.g. {_uri_of(fs, posixpath.join(beside, posixpath.basename(_real_root(fs))))}" if beside else ""
        return (
            f"storage {fs.uri()} lies inside the LayerCheck run in {_uri_of(fs, where)} ({why}); a run needs a "
            f"directory of its own outside any other run's{example}"
        )
    inner = _nested_run(fs)
    if inner is not None:
        where, why = inner
        return (
            f"storage {fs.uri()} contains another LayerCheck run in {fs.uri(where)} ({why}); move that run out "
            "of this directory first, or give this run a directory of its own"
        )
    return ""


def _run_mark(rel: str) -> str:
    """Why ``rel`` (``…/epochs/<file>`` or ``…/manifest/<file>``) shows its directory's parent is
    a LayerCheck run ("" if it does not): only LayerCheck's own names count, so another tool's
    ``epochs/`` or ``manifest/`` beside a run is no run."""
    tail = "/".join(rel.split("/")[-2:])
    if EPOCH_FILE.fullmatch(tail):
        return f"it holds the epoch {tail}"
    if RECORD_FILE.fullmatch(tail):
        return f"it holds the commit record {tail}"
    return ""


def _real_root(fs: StoreFS) -> str:
    return os.path.realpath(fs.root) if fs.fs.type_name == "local" else fs.root.rstrip("/")


def _uri_of(fs: StoreFS, path: str) -> str:
    """The location of ``path`` (a full path in ``fs``'s filesystem) for a message, as ``fs.uri()`` names its root."""
    return dataclasses.replace(fs, root=path).uri()


def _raise_if_unavailable(fs: StoreFS, error: OSError) -> None:
    """A listing of the store's own directory that the storage did not answer (or refused) is the
    run's first store error, said as such and naming the store, not a directory to pass over."""
    unavailable = unavailable_error(fs.uri(), error)
    if unavailable is not None:
        raise unavailable from error


def _enclosing_run(fs: StoreFS) -> tuple[str, str] | None:
    """The nearest ancestor of the root that is a LayerCheck run, and why; two listings (its
    ``epochs/`` and ``manifest/``, usually absent) per ancestor, up to the filesystem root or bucket."""
    path = _real_root(fs)
    while (parent := posixpath.dirname(path)) and parent != path:
        path = parent
        for sub in (EPOCHS_DIR, MANIFEST_DIR):
            try:
                listed = fs.fs.get_file_info(pafs.FileSelector(posixpath.join(path, sub), allow_not_found=True))
            except OSError as error:  # e.g. no permission to list there: nothing to see
                # (credentials scoped to the run's own prefix may not list its parents: the
                # store's own operations, next, say whether the storage answers this process)
                logger.debug("not checking %s for a LayerCheck run: %s", posixpath.join(path, sub), error)
                continue
            why = next((w for info in listed if info.type == pafs.FileType.File and (w := _run_mark(info.path))), "")
            if why:
                return path, why
    return None


def _nested_run(fs: StoreFS) -> tuple[str, str] | None:
    """A LayerCheck run below the root (its path relative to the root), and why; one recursive listing."""
    selector = pafs.FileSelector(fs.root, allow_not_found=True, recursive=True)
    prefix = fs.root.rstrip("/") + "/"
    try:
        listed = fs.fs.get_file_info(selector)
    except OSError as error:
        _raise_if_unavailable(fs, error)
        logger.warning("could not check %s for another LayerCheck run below it: %s", fs.uri(), error)
        return None
    for info in sorted(listed, key=lambda i: i.path):
        rel = info.path[len(prefix) :] if info.path.startswith(prefix) else info.path
        if info.type == pafs.FileType.File and rel.count("/") >= 2 and (why := _run_mark(rel)):
            return rel.rsplit("/", 2)[0], why
    return None


def _root_name(rel: str) -> str:
    match = _ROOT_TMP.fullmatch(rel)
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
            if not _OWN_DIR.fullmatch(rel):
                foreign.append(rel + "/")
        elif owned_file(rel):
            owned.append(rel)
        else:
            foreign.append(rel)
    return RunDirContents(owned=tuple(sorted(owned)), foreign=tuple(sorted(foreign)))


def owned_file(rel: str) -> bool:
    """Whether LayerCheck's own naming says it wrote ``rel`` (a path relative to a run's root): a
    shard file under ``layers/<layer>/`` (``layer_store.SHARD_FILE``), a commit record under
    ``manifest/`` (``RECORD_FILE``), an epoch (``EPOCH_FILE``), a run file in the root
    (:data:`RUN_ROOT_FILES`), a file of the run's tokenizer directly in ``tokenizer/``
    (``run_tokenizer.py``: named as ``save_pretrained`` names them), or the temporary of any of
    them. The one definition of what ``--overwrite`` and GC may delete: anything else, at any other
    place or depth, is a user's."""
    if rel.startswith(LAYERS_DIR + "/"):
        return bool(SHARD_FILE.fullmatch(rel))
    if rel.startswith(TOKENIZER_DIR + "/"):
        return bool(TOKENIZER_FILE.fullmatch(rel[len(TOKENIZER_DIR) + 1 :]))
    if rel.startswith(MANIFEST_DIR + "/"):
        return bool(RECORD_FILE.fullmatch(rel))
    if rel.startswith(EPOCHS_DIR + "/"):
        return bool(EPOCH_FILE.fullmatch(rel))
    return "/" not in rel and _root_name(rel) in RUN_ROOT_FILES


def clear_run(fs: StoreFS, *, keep: frozenset[str] = frozenset()) -> int:
    """Delete every file LayerCheck wrote in the run directory (but ``keep``, e.g. the lease of
    the run that is clearing it, and the epochs, which are never deleted: a new run's epoch must
    stay newer than any earlier owner's) and the then-empty ``layers/``, ``manifest/`` and ``tokenizer/``; returns the
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
    for rel in (LAYERS_DIR, MANIFEST_DIR, TOKENIZER_DIR):
        try:
            fs.fs.delete_dir(fs.path(rel))
        except FileNotFoundError:
            pass
    logger.warning("--overwrite: deleted %d file(s) an earlier run left in %s", len(doomed), fs.uri())
    return len(doomed)
