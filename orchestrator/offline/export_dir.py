"""An export's output directory appears whole or not at all.

An export writes into a temporary sibling of its output directory, ``.{OUT}.export-{pid}-{token}.tmp``
(the same filesystem, so a rename moves it), and renames it into place only once every file is
written and flushed: an export that fails, or is killed, midway leaves no ``OUT`` that looks like
a model and lacks its weights. A failure removes the temporary; a kill leaves it, and the next
export to the same ``OUT`` removes it once its process is gone (a live one's is left alone: an
export still running), naming it in the log either way.

A DeepSpeed export may add a tag to a checkpoint directory that already holds others: then the
tag's directory is moved in first and ``latest`` last, each by one rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def _staging_pattern(out: Path) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(out.name)}\.export-(\d+)-[0-9a-f]{{8}}\.tmp$")


def clear_leftovers(out: Path) -> None:
    """Remove the temporaries of exports to ``out`` whose process is gone (a kill's leftovers);
    log each one found, removed or left to the process still writing it."""
    if not out.parent.is_dir():
        return
    pattern = _staging_pattern(out)
    for path in sorted(out.parent.iterdir()):
        found = pattern.match(path.name)
        if found is None:
            continue
        pid = int(found.group(1))
        if pid != os.getpid() and _alive(pid):
            logger.info("export: leaving %s alone: the export writing it (process %d) still runs", path, pid)
            continue
        logger.warning(
            "export: removing %s, what an interrupted export to %s left (process %d is gone)", path, out, pid
        )
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A new, empty temporary sibling of ``out`` to write the export in (its parent made if need
    be); removed when the block ends, which publishes it (:func:`publish`, :func:`publish_tag`)
    once the export is complete, or raises."""
    clear_leftovers(out)
    staging = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once published


def publish(staging: Path, out: Path) -> None:
    """``staging``, complete, renamed to ``out`` (absent or an empty directory): after its files
    are flushed, so that ``out`` is whole even after a power loss."""
    _fsync_tree(staging)
    os.replace(staging, out)  # onto an empty directory too (POSIX rename)
    _fsync(out.parent)
    logger.debug("export: %s renamed to %s", staging, out)


def publish_tag(staging: Path, out: Path, tag: str) -> None:
    """A DeepSpeed checkpoint written at ``staging`` (``tag/``, ``latest``, DeepSpeed's scripts)
    moved into ``out``: all of it by one rename when ``out`` is absent or empty; else the tag's
    directory first, the other files next and ``latest`` last, so ``latest`` never names a
    partial tag."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        publish(staging, out)
        return
    _fsync_tree(staging)
    os.rename(staging / tag, out / tag)
    names = sorted(p.name for p in staging.iterdir())
    for name in [n for n in names if n != "latest"] + [n for n in names if n == "latest"]:
        os.replace(staging / name, out / name)
    _fsync(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder, name))
        _fsync(Path(folder))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
