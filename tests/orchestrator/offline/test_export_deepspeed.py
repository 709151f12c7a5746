"""``layercheck export --format deepspeed`` on a store written by a real 2-rank ZeRO-3 run:
DeepSpeed's ``load_checkpoint`` resumes from the export exactly as the in-place composite
restore does, and DeepSpeed's own ``zero_to_fp32`` reads it back to the composite's weights."""

from __future__ import annotations

import pytest
import torch

from layercheck.orchestrator.cli.main import main
from tests.support import composite_jobs as jobs
from tests.support.dist_harness import run_ranks

T = 5  # embed@4, block.0@4, block.1@5, norm@5


@pytest.fixture(scope="module")
def trained_run(tied_llama_jobs):
    """2 ZeRO-3 ranks trained 6 steps, persisting a base at 2 and some layers at 4, 5 and 6; the
    run's config (cluster.num_workers = 2: the export's default world size) in run.json."""
    return tied_llama_jobs["store"]


@pytest.mark.slow
def test_deepspeed_export_resumes_like_the_in_place_restore(trained_run, tmp_path, monkeypatch):
    store, expect, _ = trained_run
    out = tmp_path / "ds"
    assert main(["export", store, "--step", str(T), "--format", "deepspeed", "--out", str(out)]) == 0
    assert (out / "latest").read_text().strip() == f"step{T}"
    assert (out / "zero_to_fp32.py").is_file()
    assert sorted(p.name for p in (out / f"step{T}").glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]

    results = run_ranks(jobs.check_export_job, 2, str(out), store, T, expect)
    for r in results:
        assert r["mismatches"] == [], "load_checkpoint gave other weights or moments than the composite"
        assert r["client_state"]["step"] == T and r["client_state"]["versions"].keys() == set(jobs.ALL)
        from_checkpoint, in_place = r["checkpoint"], r["in_place"]
        assert from_checkpoint["step"] == in_place["step"] == T
        assert from_checkpoint["lr"] == in_place["lr"] and from_checkpoint["group_lrs"] == in_place["group_lrs"]
        assert from_checkpoint["loss"] == in_place["loss"]
        assert from_checkpoint["train_losses"] == in_place["train_losses"]

    # DeepSpeed's own consolidation reads the export back to the composite's fp32 weights.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(out))
    expected = jobs.expected_state(expect, T)
    model = jobs.reference_model(jobs.run_config(), expected)
    for name, _ in model.named_parameters():
        assert torch.equal(state[name].reshape(-1), expected[f"fp32/{name}"]), name
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # tied
