"""``layercheck export --format dcp`` on a store written by a real 2-rank ZeRO-3 run (the store is
layers, not engine files): 2 ranks build the run's model under ``fully_shard``, load the composite
and save it with ``torch.distributed.checkpoint``; an FSDP2 user's own model and AdamW at another
world size (3 ranks, uneven shards) read it with ``dcp.load`` + ``set_state_dict``, and hold the
composite's weights, moments and Adam step counts bit for bit, at the run's learning rate of T."""

from __future__ import annotations

import json

import pytest
import torch

from layercheck.orchestrator.cli.main import main
from layercheck.orchestrator.offline.export_dcp import PROVENANCE_FILE
from layercheck.workers.engine import layer_map_for
from layercheck.workers.lr_schedule import lr_at
from tests.support import composite_jobs, dcp_jobs
from tests.support.dist_harness import run_ranks

T = 5  # embed@4, block.0@4, block.1@5, norm@5


@pytest.mark.slow
def test_dcp_export_loads_into_an_fsdp2_model_at_another_world_size(tied_llama_jobs, tmp_path):
    from safetensors.torch import load_file

    store, expect, _ = tied_llama_jobs["store"]
    out = tmp_path / "dcp"
    assert main(["export", store, "--step", str(T), "--format", "dcp", "--out", str(out)]) == 0
    assert (out / ".metadata").is_file()
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # run.json's 2 ranks
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["step"] == T and provenance["versions"].keys() == set(composite_jobs.ALL)

    results = run_ranks(dcp_jobs.load_dcp_job, 3, str(out), str(tmp_path))
    loaded = load_file(str(tmp_path / dcp_jobs.LOADED))
    expected = composite_jobs.expected_state(expect, T)
    assert sorted(loaded) == sorted(expected)  # the tied head is the embedding: one parameter
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []

    run = composite_jobs.run_config()
    versions = composite_jobs.composite_versions(T)
    step_of = {p.name: versions[layer.name] for layer in layer_map_for(run.model).layers for p in layer.params}
    for rank, r in enumerate(results):
        assert r["steps"] == step_of, f"rank {rank}: Adam step counts are not the versions' steps"
        # the user's groups take the checkpoint's hyper-parameters: the run's learning rate at T, its
        # weight decay on the matrices and none on the norms, as the run grouped them; torch's kernel choice
        assert [(g["lr"], g["weight_decay"], g["foreach"]) for g in r["groups"]] == [
            (pytest.approx(lr_at(T, run.optim)), run.optim.weight_decay, None),
            (pytest.approx(lr_at(T, run.optim)), 0.0, None),
        ]
    rows = [r["local_rows"]["model.embed_tokens.weight"] for r in results]
    assert rows == [86, 86, 84]  # resharded over 3 ranks, unevenly (as torch.chunk splits 256 rows)
