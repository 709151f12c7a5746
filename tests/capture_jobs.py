"""Rank jobs for tests/test_capture_pieces.py (spawned processes import them from here)."""

from __future__ import annotations

from typing import Any

from tests.composite_jobs import batches, full_state, make_engine, run_config
from workers.capture import capture_shards, mark, state_step
from workers.engine import shutdown
from workers.layout import state_view
from workers.step import train_step


def capture_job(rank: int, world_size: int, zero_stage: int) -> dict[str, Any]:
    """Train two steps, capture, and return what the capture covers and whether it equals the state."""
    train_engine = make_engine(run_config(zero_stage=zero_stage, num_workers=world_size))
    try:
        for step in (1, 2):
            train_step(train_engine, batches(step, rank))
        last = mark(train_engine.layout, 2)
        shards = capture_shards(train_engine.layout, state_step(train_engine.layout, last))
        state = _state(train_engine)
        covered, equal = {}, True
        for shard in shards:
            for index, piece in enumerate(shard.slices):
                covered.setdefault(piece.name, []).append((piece.offset, piece.length))
                for key in ("fp32", "exp_avg", "exp_avg_sq"):
                    want = state[f"{key}/{piece.name}"][piece.offset : piece.offset + piece.length]
                    equal = equal and bool(shard.view(key, index).equal(want))
        numel = {name: int(t.numel()) for name, t in state.items() if name.startswith("fp32/")}
        train_step(train_engine, batches(3, rank))  # the optimizer stepped again, never reported
        ahead = state_step(train_engine.layout, last)
        return {"step": shards[0].step, "covered": covered, "equal": equal, "numel": numel, "ahead": ahead}
    finally:
        shutdown(train_engine)


def _state(train_engine: Any) -> dict[str, Any]:
    """``{"<key>/<param>": flat tensor}``: gathered at ZeRO-3, the rank's own replica at ZeRO-0."""
    layout = train_engine.layout
    if layout.stage != 0:
        return full_state(train_engine, list(train_engine.layer_map.names))
    return {
        f"{key}/{piece.slice.name}": state_view(layout.optimizer, piece, key).clone()
        for name in train_engine.layer_map.names
        for piece in layout[name].needed
        for key in ("fp32", "exp_avg", "exp_avg_sq")
    }
