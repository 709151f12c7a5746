"""A stale DeepSpeed JIT build lock is named, not waited on forever."""

import logging
import os
import subprocess
import sys
import time

import pytest

from layercheck.workers.env import check_build_locks, extension_locks


def _lock(root, age_s):
    build = root / "py312_cpu" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    lock = build / "lock"
    lock.write_text("")
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock, build


def test_an_old_lock_with_no_build_running_is_an_error_naming_it(tmp_path):
    lock, _ = _lock(tmp_path, 3600)
    assert extension_locks(str(tmp_path)) == [str(lock)]
    with pytest.raises(RuntimeError, match=f"stale DeepSpeed build lock {lock}.*rm {lock}"):
        check_build_locks(str(tmp_path))


def test_a_lock_of_a_live_build_is_only_logged(tmp_path, caplog):
    lock, build = _lock(tmp_path, 3600)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=build)
    try:
        with caplog.at_level(logging.WARNING):
            check_build_locks(str(tmp_path))
    finally:
        builder.kill()
        builder.wait()
    assert str(lock) in caplog.text


def test_a_fresh_lock_is_only_logged_and_no_lock_is_silent(tmp_path, caplog):
    check_build_locks(str(tmp_path))
    lock, _ = _lock(tmp_path, 5)
    with caplog.at_level(logging.WARNING):
        check_build_locks(str(tmp_path))
    assert str(lock) in caplog.text
