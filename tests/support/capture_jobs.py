"""Rank jobs for tests/workers/test_capture_pieces.py (spawned processes import them from here)."""

from __future__ import annotations

from typing import Any

from layercheck.workers.capture import capture_shards, mark, state_step
from layercheck.workers.engine import shutdown
from layercheck.workers.layout import state_view
from layercheck.workers.step import train_step
from tests.support.engines import batches, full_state, make_engine
from tests.support.models import TIED_LLAMA


def capture_job(rank: int, world_size: int, zero_stage: int) -> dict[str, Any]:
    """Train two steps, capture, and return what the capture covers and whether it equals the state."""
    train_engine = make_engine(zero_stage, hf_config=TIED_LLAMA)
    try:
        for step in (1, 2):
            train_step(train_engine, batches(train_engine, step, rank))
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
        train_step(train_engine, batches(train_engine, 3, rank))  # the optimizer stepped again, never reported
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


class _Recorder:
    """The coordinator as far as a capture goes: no policy, no writers; keeps what is handed over."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, list[Any]]] = []

    def report(self, drift: Any, lr: float) -> None:
        return None

    def decision(self, handle: Any) -> None:
        return None

    def persist(self, shards: Any, *, base: bool) -> None:
        pass

    def progress(self, progress: Any) -> None:
        pass

    def capture(self, shards: list[Any], *, step: int, error: BaseException) -> None:
        self.captured.append((step, shards))


def released_capture_job(rank: int, world_size: int, stage: int, precision: str) -> dict[str, Any]:
    """A survivor blocked in a collective is released by an abort asked from another thread (as
    Ray Train's controller asks, through ``request_abort``), its step raises, and it captures.

    On NCCL (CUDA, one rank) the abort is torch's own and the collective after it raises; a
    one-rank group never blocks, so the abort comes first. On gloo (CPU) the real abort is not
    needed (gloo raises by itself) and leaves the group working; the block and the release are
    then scripted (a collective that waits until an abort labelled NCCL sets it free). Either way
    the capture must equal the optimizer's state at the last completed step, bit for bit."""
    import threading

    import torch
    import torch.distributed as dist

    from layercheck.workers import collective_abort
    from layercheck.workers.capture import capture_pieces
    from layercheck.workers.loop import StepProtocol
    from layercheck.workers.shard import STATE_KEYS

    train_engine = make_engine(stage, precision)
    layout = train_engine.layout
    out: dict[str, Any] = {"backend": str(dist.get_backend())}
    real = collective_abort.CollectiveAbort(backend=out["backend"])
    if collective_abort.raises_by_itself(out["backend"]):
        real.arm()
        out["real_answer"] = real.request("a peer is gone (test)").value
        probe = torch.ones(1)
        dist.all_reduce(probe)  # the group still works
        out["group_works"] = probe.item() == world_size
        released = threading.Event()
        abort = collective_abort.CollectiveAbort(backend="nccl", abort=released.set)  # stands for ncclCommAbort

        def collective() -> None:  # stands for a kernel spinning on a lost peer
            released.wait()
            raise RuntimeError("NCCL communicator was aborted (scripted)")
    else:
        abort = real

        def collective() -> None:
            dist.all_reduce(torch.ones(1, device=torch.device("cuda", torch.cuda.current_device())))

    collective_abort.install(abort)
    recorder = _Recorder()
    protocol = StepProtocol(layout, recorder, rank=rank, abort=abort)
    for step in (1, 2):
        loss, drift = train_step(train_engine, batches(train_engine, step, rank))
        protocol.after_step(step, drift, loss=loss, lr=0.0, compute_s=0.0)
    pieces = capture_pieces(layout)
    reference = {
        (name, index, key): state_view(layout.optimizer, piece, key).detach().cpu().clone()
        for name, taken in pieces.items()
        for index, piece in enumerate(taken)
        for key in STATE_KEYS
    }
    answers: list[str] = []
    controller = threading.Thread(target=lambda: answers.append(collective_abort.request_abort("rank 1 died (test)")))
    controller.start()
    if not collective_abort.raises_by_itself(out["backend"]):
        controller.join()  # a one-rank NCCL group never blocks: the abort comes first
    try:
        collective()
        out["raised"] = ""
    except Exception as error:  # noqa: BLE001 - what the test is about
        out["raised"] = f"{type(error).__name__}: {error}"[:200]
        protocol.on_failure(error)
    controller.join()
    collective_abort.install(None)
    out["answers"] = answers
    out["answer_after"] = abort.request("asked again (test)").value
    out["copier"] = type(protocol._handover.copier).__name__
    out["captured_steps"] = [step for step, _ in recorder.captured]
    equal, compared = True, 0
    for _, shards in recorder.captured:
        for shard in shards:
            for index, _piece in enumerate(shard.slices):
                for key in STATE_KEYS:
                    got = shard.view(key, index)
                    want = reference[(shard.layer, index, key)]
                    equal = equal and got.device.type == "cpu" and torch.equal(got, want.to(got.dtype))
                    compared += got.numel()
    out["equal"], out["compared"] = equal, compared
    out["pinned"] = all(
        shard.tensors[key].is_pinned() for _, shards in recorder.captured for shard in shards for key in STATE_KEYS
    )
    try:
        shutdown(train_engine)  # after an abort the default group is gone: only the engine is released
    except Exception as error:  # noqa: BLE001 - reported, not the point of the test
        out["shutdown_error"] = repr(error)[:200]
    return out
