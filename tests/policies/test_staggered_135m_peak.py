"""The staggered schedule's bound on the bytes of one step, on a real model's shape,
deterministically (no timing, no weights): on a SmolLM-135M-shaped model the staggered schedule
hands over at most max(1/8 of a full checkpoint, the largest layer) in one step, where full
checkpoints hand over a whole one at each save, and writes no more than they do over the run;
and, with ``spread_phases``, where storage writes just the schedule's bytes per step no more than
its largest layer waits to be written at once, where full checkpoints leave most of a checkpoint
waiting."""

import random

import pytest

from layercheck.policies.configs import StaggeredConfig
from layercheck.policies.decision import StepObservation
from layercheck.policies.simulation import BYTES_PER_PARAM, simulate_config, simulate_interval
from layercheck.policies.trace import DriftTrace
from layercheck.workers.config import ModelConfig
from layercheck.workers.engine import layer_map_for

SMOLLM_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}
STEPS = 800


@pytest.fixture(scope="module")
def numel():
    return layer_map_for(ModelConfig(hf_config=SMOLLM_135M)).numel  # on the meta device: nothing allocated


def alike(numel, seed=0):
    """Every layer drifts at the same pace, with per-step noise (the measured fine-tuning case)."""
    rng = random.Random(seed)
    steps = tuple(
        StepObservation(step=t, lr=1e-5, drift={n: 2e-6 * rng.lognormvariate(0.0, 0.25) for n in numel})
        for t in range(1, STEPS + 1)
    )
    return DriftTrace(layers=tuple(numel), numel=dict(numel), steps=steps)


def test_the_model_is_135m_shaped(numel):
    assert len(numel) == 32 and "lm_head" not in numel  # embed, 30 blocks, norm; the head is tied
    assert sum(numel.values()) == pytest.approx(134.5e6, rel=0.01)
    assert numel["embed"] / sum(numel.values()) == pytest.approx(0.21, abs=0.005)


@pytest.mark.parametrize("period", [8, 20, 100])
def test_the_peak_step_is_at_most_an_eighth_of_a_checkpoint_or_the_largest_layer(numel, period):
    trace = alike(numel)
    full = sum(numel.values()) * BYTES_PER_PARAM
    bound = max(full / 8, max(numel.values()) * BYTES_PER_PARAM)
    staggered = simulate_config(trace, StaggeredConfig(period=period), label="staggered")
    interval = simulate_interval(trace, period)
    assert interval.peak_step_bytes == full
    assert staggered.peak_step_bytes <= bound
    assert staggered.bytes_written <= interval.bytes_written * 1.01  # integer periods, the run's ends


@pytest.mark.parametrize("period", [8, 20, 50, 100, 200])
def test_spread_phases_leave_at_most_the_largest_layer_waiting_for_storage_at_the_schedules_rate(numel, period):
    """Saves evenly over the period, not on consecutive steps: at 100 steps those leave 0.69 of a
    checkpoint waiting once a period (200 steps: 0.85), as full checkpoints do (0.99)."""
    trace = alike(numel)
    full = sum(numel.values()) * BYTES_PER_PARAM
    largest = max(numel.values()) * BYTES_PER_PARAM
    spread = simulate_config(trace, StaggeredConfig(period=period, spread_phases=True), label="spread")
    packed = simulate_config(trace, StaggeredConfig(period=period), label="packed")
    interval = simulate_interval(trace, period)
    assert interval.peak_backlog_bytes >= 0.85 * full
    assert spread.peak_backlog_bytes <= 1.05 * largest  # (0.95-0.99 of it here)
    assert spread.bytes_written == packed.bytes_written
    assert spread.mean_unsaved_drift <= 1.01 * packed.mean_unsaved_drift  # (no warm-up: 0.95-1.0 of it)
    warmed = simulate_config(trace, StaggeredConfig(period=period, warmup_steps=period, spread_phases=True), label="w")
    assert warmed.peak_backlog_bytes <= 1.05 * largest  # storage sized from the first save on
    if period >= 50:  # more steps than the model's 32 layers: consecutive saves pile up
        assert packed.peak_backlog_bytes > 1.5 * largest
