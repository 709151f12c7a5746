"""The FSDP2 user's own checkpoints in the benchmark: ``torch.distributed.checkpoint`` (DCP) every
N steps with rollback, what torchtitan and the FSDP2 ``Trainer`` save today.

``dcp`` saves ``get_state_dict(model, optimizer)`` (the model's and optimizer's sharded state by
canonical name) with ``dcp.save`` on the training thread. ``dcp-async`` does what torchtitan's
asynchronous mode does: wait for the previous save's upload, stage the state in host memory, and
let DCP's upload thread write the files (``dcp.async_save``, ``AsyncCheckpointerType.THREAD``).
Staging where there is a GPU is DCP's ``DefaultStager`` into pinned memory on a side stream, waited
for just before the next optimizer step changes the weights (an optimizer pre-step hook, as
torchtitan's ``maybe_wait_for_staging``); on CPU torch 2.13 offers neither (pinned memory and
non-blocking copies need an accelerator), so it is ``async_save``'s default: a blocking copy to
host memory on the training thread. A background save's own collectives (the plan exchange, the
metadata) run over a gloo group of its own, as DCP's documentation advises, never interleaved
with training's on the default group.

A failure (:meth:`DCPFull.recover`): the saves in flight finish, the newest checkpoint at or before
``t_fail`` is loaded (``dcp.load`` into the state dicts, then ``set_state_dict``), the engine moves
to its step and the lost steps are re-run. A checkpoint is usable once its ``.metadata`` exists:
DCP's coordinator writes it after every rank's files. The newest two are kept, as users' retention does.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from layercheck.bench.strategies import Kind, Strategy
from layercheck.orchestrator.local.local_coordinator import LocalCoordinator
from layercheck.workers.engine import TrainEngine, seek_step
from layercheck.workers.step import train_step

logger = logging.getLogger(__name__)

#: The checkpoints kept on disk, newest first (older ones are deleted as a new one completes).
KEEP = 2


def staging_mode() -> str:
    """How ``dcp-async`` stages the state: ``pinned`` (a GPU: DCP's ``DefaultStager`` into pinned
    host memory on a side stream) or ``host copy`` (CPU: ``async_save``'s blocking copy)."""
    return "pinned" if torch.cuda.is_available() else "host copy"


def _make_stager() -> Any:
    """DCP's pinned-memory stager where there is a GPU; ``None`` (``async_save``'s own) elsewhere."""
    if staging_mode() != "pinned":
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # pinned buffers, filled on a side stream without blocking; one process, so no shared memory
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
        )
    )


class DCPFull:
    """``dcp.save`` (``dcp``) or ``dcp.async_save`` (``dcp-async``) of the whole model and optimizer
    every ``interval`` steps; rollback with ``dcp.load`` and re-run the lost steps."""

    def __init__(
        self,
        train_engine: TrainEngine,
        strategy: Strategy,
        root: Path,
        coordinator: LocalCoordinator,
        *,
        batches: Callable[[int], list[torch.Tensor]],
        losses: Callable[[], dict[int, float]],
        reset: Callable[[], None],
    ) -> None:
        if train_engine.adapter.kind != "fsdp2":
            raise ValueError(
                f"strategy {strategy.name}: DCP's baseline checkpoints an FSDP2 model, not a "
                f"{train_engine.adapter.describe()} engine (run it with --engine fsdp2)"
            )
        self.train_engine, self.interval, self.root = train_engine, strategy.interval, root
        self.coordinator = coordinator
        self.batches, self.losses, self.reset = batches, losses, reset
        self.is_async = strategy.kind is Kind.DCP_ASYNC
        self.rank = torch.distributed.get_rank()
        # collective on every rank: each builds its baseline at the same point of the run
        self.group = torch.distributed.new_group(backend="gloo") if self.is_async else None
        self.stager = _make_stager() if self.is_async else None
        self.upload: tuple[int, Future[Any]] | None = None  # the save in flight: (step, its upload)
        self.staging: Future[Any] | None = None  # pinned staging in flight (GPU only)
        self._hook = train_engine.optimizer.register_step_pre_hook(self._before_optimizer_step)
        self.complete: list[int] = []
        self.persisted: dict[int, tuple[str, ...]] = {}
        self.stall_s = 0.0
        self.bytes_written = 0

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.train_engine.engine, self.train_engine.optimizer)
        return {"model": model_state, "optim": optim_state}

    def _path(self, step: int) -> Path:
        return self.root / f"step{step}"

    def after_step(self, step: int) -> None:
        if step % self.interval:
            return
        started = time.monotonic()
        self._wait_upload()  # torchtitan too waits for the previous save before staging the next
        if self.is_async:
            from torch.distributed.checkpoint import async_save
            from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

            response = async_save(
                self._state(), checkpoint_id=str(self._path(step)), process_group=self.group, async_stager=self.stager
            )
            if isinstance(response, AsyncSaveResponse):  # staging runs on: wait before the weights change
                self.staging, self.upload = response.staging_completion, (step, response.upload_completion)
            else:
                self.upload = (step, response)
        else:
            from torch.distributed.checkpoint import save

            save(self._state(), checkpoint_id=str(self._path(step)))
            self._completed(step)
        self.persisted[step] = tuple(self.train_engine.layer_map.names)
        self.stall_s += time.monotonic() - started

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The staged copy must be taken before the step changes what it copies (GPU staging only)."""
        if self.staging is None:
            return
        started = time.monotonic()
        self.staging.result()
        self.staging = None
        self.stall_s += time.monotonic() - started

    def _wait_upload(self) -> None:
        if self.upload is None:
            return
        step, upload = self.upload
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        upload.result()
        self.upload = None
        self._completed(step)

    def _completed(self, step: int) -> None:
        """A save is whole on every rank once its own returns (DCP's finish step gathers every rank's
        writes, then the coordinator writes ``.metadata``): rank 0 counts its files and deletes the
        checkpoints older than the newest :data:`KEEP`."""
        self.complete.append(step)
        if self.rank != 0:
            return
        self.bytes_written += sum(f.stat().st_size for f in self._path(step).rglob("*") if f.is_file())
        for old in self.complete[:-KEEP]:
            shutil.rmtree(self._path(old), ignore_errors=True)

    def _drain(self) -> float:
        started = time.monotonic()
        self._wait_upload()
        torch.distributed.barrier()
        return time.monotonic() - started

    def recover(self, t_fail: int) -> dict[str, Any]:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.coordinator.last_complete_step()  # every rank's report of t_fail is in, as in LayerCheck's recovery
        drain_s = self._drain()
        started = time.monotonic()
        usable = [s for s in self.complete if s <= t_fail and (self._path(s) / ".metadata").is_file()]
        plan_s = time.monotonic() - started
        started = time.monotonic()
        if usable:
            state = self._state()
            load(state, checkpoint_id=str(self._path(usable[-1])))
            set_state_dict(
                self.train_engine.engine,
                self.train_engine.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
            self.train_engine.layout.refresh(list(self.train_engine.layer_map.names))
            seek_step(self.train_engine, usable[-1])  # the counters and the LR schedule DCP's files do not hold
        else:
            self.reset()  # nothing saved yet: back to the initial weights
        load_s = time.monotonic() - started
        resume_after = usable[-1] if usable else 0
        started = time.monotonic()
        replay_diff, losses = 0.0, self.losses()
        for step in range(resume_after + 1, t_fail + 1):
            loss, _ = train_step(self.train_engine, self.batches(step))
            replay_diff = max(replay_diff, abs(loss - losses[step]) if step in losses else 0.0)
        replay_s = time.monotonic() - started
        self.coordinator.restart(resume_after=t_fail, persisted_steps={})
        return {
            "resume_after": resume_after,
            "start_step": t_fail + 1,
            "plan_s": plan_s,
            "load_s": load_s,
            "replay_s": replay_s,
            "drain_s": drain_s,
            "replay_max_loss_diff": replay_diff,
        }

    def finish(self) -> tuple[int, int]:
        self._drain()
        self._hook.remove()
        if self.stager is not None:
            self.stager.close()
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
        return self.bytes_written, len(self.complete)
