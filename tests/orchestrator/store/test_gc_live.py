"""``layercheck gc --grace 1`` run again and again while another process keeps writing and
committing versions to the same local store (the "gc during a live run" row of the reliability
page's fault-injection matrix)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layercheck.orchestrator.cli.main import build_parser, main
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.orchestrator.store.recovery_source import resolve_plan

LAYERS = {"embed": 48, "block.0": 48, "norm": 48}
#: A crashed write's shard, an hour old (GC takes it), and a write in progress (kept fresh: GC leaves it).
OLD_ORPHAN = "layers/embed/0000099998-rank00000of00002-0a0b0c0d.safetensors"
IN_FLIGHT = "layers/norm/0000099999-rank00001of00002-1a2b3c4d.safetensors.5e6f7a8b.tmp"


@pytest.mark.slow
def test_gc_during_a_live_run_deletes_only_what_no_recovery_needs(tmp_path, capsys):
    """While a writer commits a version of three layers at every step for 3 s, gc runs over and
    over: every version left in the manifest stays whole after each pass, the write in progress
    (younger than the grace) is kept, the old orphan goes, the writer never fails, and at the end
    verify passes and recovery resolves every layer at the writer's last step."""
    run = tmp_path / "run"
    build_parser()  # the CLI's imports, once: not inside the first pass
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.store_writer_proc", str(run), "--layers", ",".join(LAYERS)]
        + ["--steps", "1", "--for-s", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    store = LayerStore.open(str(run), fsync=False)
    deleted, passes = 0, 0
    try:
        while writer.poll() is None:
            if not (run / "manifest").is_dir():
                time.sleep(0.05)
                continue
            if passes == 0:
                _plant(run / OLD_ORPHAN, age_s=3600)
            # still being written through the whole pass: its mtime keeps moving (ahead of it, so
            # that a pass slowed by a busy machine still finds it younger than the grace)
            _plant(run / IN_FLIGHT, age_s=-60)
            assert main(["gc", str(run), "--grace", "1"]) == 0
            passes += 1
            out = capsys.readouterr().out
            deleted += out.count("deleted version ")
            for record in store.versions():  # all the manifest holds now, what retention kept included
                assert store.check_version(record, deep=False) == [], (record.version_id, out)
            assert (run / IN_FLIGHT).exists() and not (run / OLD_ORPHAN).exists(), out
    finally:
        if writer.poll() is None:
            writer.kill()
        stdout, stderr = writer.communicate(timeout=60)
    assert writer.returncode == 0, stderr
    last = int(stdout.split("last step ")[1])
    assert passes >= 2 and deleted > 0, (passes, deleted)  # gc ran, and pruned, while the run wrote

    assert main(["verify", str(run)]) == 0, capsys.readouterr().out
    resolved = resolve_plan(store, LAYERS, deep=True)
    assert {layer: r.step for layer, r in resolved.records.items()} == dict.fromkeys(LAYERS, last)


def _plant(path: Path, *, age_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"a shard being written, or one a crashed write left")
    then = time.time() - age_s
    os.utime(path, (then, then))
