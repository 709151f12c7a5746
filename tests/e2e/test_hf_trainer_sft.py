"""examples/hf_trainer_sft.py end to end through a real local Ray, as a user runs it: TRL's
SFTTrainer with DeepSpeed (a LoRA adapter from peft at ZeRO-2 with DeepSpeed's schedule; the
whole model at ZeRO-3 with the Trainer's own) on 2 Ray Train workers, LayerCheck added by its
callback, one worker SIGKILLed. The restart resumes at t_fail + 1 in the next epoch (48 pairs, 6 steps an
epoch: the Trainer's step, learning-rate schedule and shuffled data order all moved), and with
every layer persisted at t_fail the losses after recovery are the failure-free run's."""

from __future__ import annotations

import pytest

from tests.support.example_runs import assert_exact_recovery, run_examples

STEPS = 12
KILL_AT = 8  # step 9 is epoch 1's third step
# every-step mode lets a layer's versions queue up: each step's is written
ARGS = ("--steps", str(STEPS), "--rows", "48", "--policy", "every-step", "--no-fsync")


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [("--zero-stage", "2", "--schedule", "deepspeed", "--lora"), ("--zero-stage", "3", "--schedule", "trainer")],
    ids=["lora-zero2-deepspeed-schedule", "zero3-trainer-schedule-in-place"],
)
def test_sft_trainer_recovers_at_t_fail_plus_one_on_the_failure_free_trajectory(tmp_path, setup):
    # the whole model's failure is recovered in place: the survivor runs the loop (a new Trainer) again
    in_place = ("--in-place",) if "--lora" not in setup else ()
    runs = {
        "clean": (*ARGS, *setup, "--kill-at-step", "0"),
        "failed": (*ARGS, *setup, "--kill-at-step", str(KILL_AT), *in_place),
    }
    clean, failed = run_examples("hf_trainer_sft.py", tmp_path, runs).values()
    assert_exact_recovery(clean, failed, steps=STEPS, kill_at=KILL_AT)
    (recovery,) = failed["summary"]["recoveries"]
    assert recovery["path"] == ("in place" if in_place else "full restart"), recovery
    # the callback's run exports with no extra file: the model, and the Trainer's tokenizer the callback kept
    import transformers

    from layercheck.orchestrator.cli.main import main

    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "failed"), "--format", "hf", "--out", str(out)]) == 0
    assert transformers.AutoTokenizer.from_pretrained(str(out)).chat_template
    if "--lora" not in setup:
        assert transformers.AutoModelForCausalLM.from_pretrained(str(out)).config.model_type == "llama"
        return
    # the adapter alone, in peft's format, loads onto its base
    import peft

    from examples.hf_trainer_sft import MODEL

    adapter = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_config(MODEL), str(out))
    assert any("lora_" in name for name, _ in adapter.named_parameters())
    # the base was built from a config, not loaded: no weights to merge into, and the error says so
    assert main(["export", str(tmp_path / "failed"), "--format", "hf", "--merge", "--out", str(tmp_path / "m")]) == 2
