"""examples/own_loop.py end to end through a real local Ray, as a user runs it: their own Ray
Train loop (own model, data, answer-only loss, DeepSpeed config) with LayerCheck attached, one
worker SIGKILLed; recovery at t_fail + 1 continues the failure-free losses exactly when every
layer is persisted every step."""

from __future__ import annotations

import pytest

from tests.support.example_runs import assert_exact_recovery, run_example

STEPS = 10
KILL_AT = 6


@pytest.mark.slow
def test_own_loop_recovers_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path):
    args = ("--steps", str(STEPS), "--policy", "every-step")
    clean = run_example("own_loop.py", tmp_path, "clean", *args, "--kill-at-step", "0")
    failed = run_example("own_loop.py", tmp_path, "failed", *args, "--kill-at-step", str(KILL_AT))
    assert_exact_recovery(clean, failed, steps=STEPS, kill_at=KILL_AT)


@pytest.mark.slow
def test_with_the_api_default_schedule_a_failure_before_the_first_saves_resumes_at_t_fail_plus_one(tmp_path):
    """``CheckpointConfig()``'s schedule saves a layer every 100 steps: in an 8-step run no layer is
    saved by the policy before rank 1 dies after step 4. ``attach`` handed the state the loop built
    over as every layer's version at step 0, so recovery resumes at 5 (rank 0's slices from its
    capture), not at step 1."""
    failed = run_example("own_loop.py", tmp_path, "early", "--steps", "8", "--period", "100", "--kill-at-step", "4")
    summary = failed["summary"]
    (recovery,) = summary["recoveries"]
    assert (recovery["t_fail"], recovery["resumed_at"], recovery["steps_redone"]) == (4, 5, 0)
    assert recovery["max_staleness"] == 4
    bases = {layer: (sources[-1]["origin"], sources[-1]["step"]) for layer, sources in recovery["sources"].items()}
    assert all(origin == "policy" for origin, _ in bases.values()), bases  # (stored: a loop LayerCheck cannot rebuild)
    assert sum(step == 0 for _, step in bases.values()) >= len(bases) // 2, bases  # most not saved since step 0
    assert sorted(int(k) for k in failed["losses"]) == list(range(1, 9))
    # the store carries what export needs (model.json): the trained model exports as it is
    import transformers

    from layercheck.orchestrator.cli.main import main

    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "early"), "--format", "hf", "--out", str(out)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.config.num_hidden_layers == 2 and not loaded.config.tie_word_embeddings
