"""An error before the run's first training step ends the run at once, with its cause (and the fix
where one is known), instead of being retried as a worker failure; a worker that died, or a
collective broken by a dead peer, is still a failure Ray Train retries and LayerCheck recovers."""

import pytest
import ray

from layercheck.orchestrator.runtime.setup_errors import peer_gone, setup_failure

BATCH = (
    "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
    "gradient_acc_step * world_size 16 != 4 * 1 * 2"
)


def test_an_error_every_rank_raised_is_a_setup_error_with_the_known_fix():
    message = setup_failure({1: AssertionError(BATCH), 0: AssertionError(BATCH)})
    assert message.startswith("rank 0 failed before the first training step")
    assert "not retried" in message and "ranks that raised: [0, 1]" in message and BATCH in message
    assert "Fix: DeepSpeed needs train_batch_size" in message


def test_an_unknown_setup_error_is_named_without_a_fix():
    message = setup_failure({0: ValueError("bad vocab file")})
    assert "ValueError: bad vocab file" in message and "Fix:" not in message


@pytest.mark.parametrize(
    "error",
    [
        ray.exceptions.ActorDiedError(),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"),
        RuntimeError("NCCL communicator was aborted"),
    ],
    ids=["worker-died", "gloo-peer-gone", "nccl-abort"],
)
def test_a_dead_worker_or_a_broken_collective_is_a_failure_to_recover(error):
    assert peer_gone(error)
    assert setup_failure({0: ValueError("collateral"), 1: error}) is None


@pytest.mark.slow
def test_a_loop_that_fails_before_its_first_step_runs_once_and_says_why(tmp_path):
    """A user's loop whose DeepSpeed setup fails (here: raises its batch-size assertion) under
    ``FailureConfig(max_failures=3)``: one attempt, the run's error is the assertion and its fix."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    import layercheck
    from tests.support.models import TINY_LLAMA

    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def loop(config):
        import os

        open(os.path.join(config["attempts"], f"{os.getpid()}"), "w").close()
        raise AssertionError(BATCH)

    import transformers

    trainer = layercheck.LayerCheckTrainer(
        loop,
        model=transformers.LlamaConfig(**TINY_LLAMA),
        checkpoint=layercheck.CheckpointConfig(
            storage=str(tmp_path / "store"), metrics=layercheck.MetricsConfig(port=0)
        ),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), failure_config=FailureConfig(max_failures=3)),
        train_loop_config={"attempts": str(attempts)},
    )
    result = trainer.fit()
    # (the rank whose error the controller saw first: either)
    assert result.error is not None and " failed before the first training step" in result.error, result.error
    assert BATCH in result.error and "Fix: DeepSpeed needs train_batch_size" in result.error
    assert len(list(attempts.iterdir())) == 2  # one attempt of 2 workers, no retry
    assert result.summary["failures"] == 0 and not result.summary["recoveries"]
    assert "ETTR" not in result.format() and "staleness" not in result.format()  # nothing it did not do
