"""An export stopped while it writes (it fails, or it is SIGKILLed): its output directory is
absent or whole, never a half-written folder that looks like a model, and a re-run succeeds
(the "kill in the middle of an export" row of the reliability page's fault-injection matrix)."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.offline.export_run import ExportError
from layercheck.orchestrator.offline.exporter import export
from layercheck.orchestrator.store.layer_store import LayerStore
from layercheck.policies.layer_map import layer_map_of
from layercheck.workers.engine import build_model
from layercheck.workers.shard import STATE_KEYS
from tests.support import composite_jobs as jobs
from tests.support.store_helpers import cut_shards, even_cuts


@pytest.fixture
def run(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """(store uri, the composite's fp32 weights): every layer of a tiny tied Llama as a base at 10."""
    uri = str(tmp_path / "run")
    store = LayerStore.open(uri, fsync=False)
    jobs.write_run_json(uri, jobs.run_config())
    weights = {}
    gen = torch.Generator().manual_seed(0)
    for layer in layer_map_of(build_model(jobs.run_config().model)).layers:
        params = {p.name: p.shape for p in layer.params}
        state = {k: {n: torch.randn(math.prod(s), generator=gen) for n, s in params.items()} for k in STATE_KEYS}
        store.write_version(cut_shards(layer.name, 10, params, state, even_cuts(layer.numel, 2)), base=True)
        weights.update(state["fp32"])
    return uri, weights


def _assert_loads(out: Path, weights: dict[str, torch.Tensor]) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach().reshape(-1), weights[name]), name


def _leftovers(out: Path) -> list[str]:
    """What an export to ``out`` may have left beside it (the temporary it writes in)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name and out.name in p.name)


def test_an_export_failing_while_it_writes_leaves_no_output_and_the_next_one_works(run, tmp_path, monkeypatch):
    """The weights' write fails after the config was written: no OUT (not a config without weights),
    nothing left beside it, the error names OUT; the same export then succeeds."""
    uri, weights = run
    out = tmp_path / "exports" / "hf"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
        with pytest.raises(ExportError, match=r"No space left on device") as failed:
            export(uri, fmt="hf", out=out)
    assert str(out) in str(failed.value)
    assert not out.exists() and _leftovers(out) == []
    assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    _assert_loads(out, weights)


def test_a_killed_exports_leftover_is_removed_by_the_next_export_and_named(run, tmp_path, caplog):
    """A temporary an export killed midway left (its process is gone) is removed, with a log line
    naming it, by the next export to the same OUT; one of a live process is left alone."""
    uri, weights = run
    out = tmp_path / "hf"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = out.parent / f".{out.name}.export-{int(gone.stdout)}-0a0b0c0d.tmp"
    live = out.parent / f".{out.name}.export-{os.getppid()}-1a2b3c4d.tmp"
    for leftover in (dead, live):
        leftover.mkdir()
        (leftover / "config.json").write_text("{}")
    with caplog.at_level(logging.INFO):
        assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    assert not dead.exists() and live.exists()
    assert dead.name in caplog.text and live.name in caplog.text
    _assert_loads(out, weights)


@pytest.mark.slow
def test_a_sigkilled_hf_export_leaves_no_half_written_model_and_a_rerun_succeeds(run, tmp_path, caplog):
    """``layercheck export --format hf`` SIGKILLed once it has written the model's config and
    before its weights: OUT is absent (or whole), and the next export writes a model that loads."""
    uri, weights = run
    out = tmp_path / "hf"
    killed = subprocess.run(
        [sys.executable, "-m", "tests.support.export_proc", "export", uri, "--format", "hf", "--out", str(out)],
        env={**os.environ, "LAYERCHECK_TEST_KILL_IN": "safe_save_file"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists() or transformers.AutoModelForCausalLM.from_pretrained(str(out))
    left = _leftovers(out)
    assert left  # the temporary it wrote in, which a SIGKILL leaves behind
    with caplog.at_level(logging.INFO):
        assert main(["export", uri, "--format", "hf", "--out", str(out)]) == 0
    assert all(name in caplog.text for name in left) and _leftovers(out) == []
    _assert_loads(out, weights)
