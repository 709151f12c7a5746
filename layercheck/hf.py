"""LayerCheck for a Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``, any ``Trainer`` subclass)
running DeepSpeed or FSDP2 (``fsdp_config={"fsdp_version": 2}``: accelerate shards only on GPUs) inside a :class:`layercheck.LayerCheckTrainer`'s ``train_loop_per_worker``::

    trainer = SFTTrainer(model=model, args=SFTConfig(deepspeed=ds_config, save_strategy="no", ...), ...)
    trainer.add_callback(layercheck.LayerCheckCallback(trainer))
    trainer = ray.train.huggingface.transformers.prepare_trainer(trainer)   # optional, as usual
    trainer.train()

The callback needs the trainer because the ``DeepSpeedEngine`` reaches callbacks only through it
(``trainer.model_wrapped``; the hooks get the unwrapped model and Accelerate's optimizer wrapper).
It attaches in ``on_train_begin``, the first hook after the ``Trainer`` built the engine and before
its first step; on a restarted worker group that loads the composite and moves the engine (step
counters, learning-rate schedule), ``state.global_step`` and the data to ``t_fail + 1``. After each
optimizer step it calls ``after_step``; at the end of training, ``finish``. The ``Trainer``'s own
checkpoints stay as the user configured them (``save_strategy="no"`` is fine).

Unless the run named a tokenizer (``CheckpointConfig(tokenizer=...)``), rank 0 keeps the
``Trainer``'s own (its ``processing_class``) in the run's store as it attaches, so that
``layercheck export --format hf`` ships it beside the model
(:mod:`layercheck.orchestrator.store.run_tokenizer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import TrainerCallback

from layercheck.hf_position import DataSeek, data_position

if TYPE_CHECKING:
    from accelerate.data_loader import DataLoaderShard
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase, Trainer, TrainerControl, TrainerState, TrainingArguments

    from layercheck.policies.layer_map import LayerMapSpec
    from layercheck.workers.engines.deepspeed import DeepSpeedEngine

logger = logging.getLogger(__name__)


class TrainerSetupError(ValueError):
    """The ``Trainer`` is not set up the way LayerCheck needs (the message says what to configure)."""


class AttachedRun(Protocol):
    """What the callback calls on a rank's attachment: :class:`layercheck.Attachment`, or a test's
    scripted stand-in."""

    start_step: int

    def after_step(self, step: int, *, loss: float) -> None: ...

    def check_steps(self, total_steps: int) -> list[str]: ...

    def finish(self) -> object: ...


class LayerCheckCallback(TrainerCallback):
    """Adds LayerCheck to ``trainer``: ``trainer.add_callback(LayerCheckCallback(trainer))``."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        layer_map: LayerMapSpec | None = None,
        drift_probe: str | None = None,
        attach: Callable[[Trainer], AttachedRun] | None = None,
    ) -> None:
        """``layer_map`` / ``drift_probe`` override the run's :class:`layercheck.CheckpointConfig`.
        ``attach`` (``trainer -> Attachment``) replaces attaching to the trainer's engine (tests
        script it)."""
        require_supported_engine(trainer)
        self.trainer = trainer
        self.layer_map = layer_map
        self.drift_probe = drift_probe
        self._attach = attach
        self.attachment: AttachedRun | None = None
        """The :class:`layercheck.Attachment`, from ``on_train_begin`` on."""
        self._seek: DataSeek | None = None
        self._loss_mark = 0.0

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        train_dataloader: DataLoaderShard | None = None,
        **kwargs: object,
    ) -> None:
        if state.global_step != 0:
            raise TrainerSetupError(
                f"the Trainer starts at step {state.global_step} (train(resume_from_checkpoint="
                "...)): with LayerCheckCallback, call trainer.train() without it; LayerCheck "
                "resumes a restarted worker group itself"
            )
        attachment = (self._attach or self._attach_engine)(self.trainer)
        self.attachment = attachment
        self._keep_tokenizer()
        if state.max_steps:
            attachment.check_steps(int(state.max_steps))
        done = attachment.start_step - 1
        if done > 0:
            self._resume(state, train_dataloader, done)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._loss_mark = self._loss_total()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.attachment is None:
            raise RuntimeError(
                "LayerCheckCallback: on_step_end before on_train_begin (add the callback before trainer.train())"
            )
        if self._seek is not None:
            state.epoch = self._seek.epoch_progress(state.epoch)
        self.attachment.after_step(state.global_step, loss=self._loss_total() - self._loss_mark)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self._seek is not None:
            self._seek.epoch_ended()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.attachment is not None:
            self.attachment.finish()

    def _attach_engine(self, trainer: Trainer) -> AttachedRun:
        from layercheck.worker import attach

        if runs_fsdp2(trainer):
            model, optimizer, scheduler = fsdp2_parts(trainer)
            return attach(
                model, optimizer, lr_scheduler=scheduler, layer_map=self.layer_map, drift_probe=self.drift_probe
            )
        return attach(deepspeed_engine(trainer), layer_map=self.layer_map, drift_probe=self.drift_probe)

    def _keep_tokenizer(self) -> None:
        """The ``Trainer``'s tokenizer into the run's store, once per run, by rank 0, where the run
        named none (:func:`~layercheck.orchestrator.store.run_tokenizer.keep_tokenizer`). Outside a
        ``LayerCheckTrainer`` run there is no store. A failure costs the export its tokenizer, not
        the training: it is logged."""
        from layercheck.orchestrator.runtime import context
        from layercheck.orchestrator.store.fs import StoreFS
        from layercheck.orchestrator.store.run_tokenizer import keep_tokenizer

        ctx = context.current()
        tokenizer = trainer_tokenizer(self.trainer)
        if ctx is None or tokenizer is None or not _rank_zero(self.trainer):
            return
        try:
            keep_tokenizer(StoreFS.open(ctx.storage_uri, fsync=ctx.fsync), tokenizer)
        except (OSError, ValueError) as error:
            logger.error("the Trainer's tokenizer was not kept in the run's store (the export will lack it): %s", error)

    def _resume(self, state: TrainerState, loader: DataLoaderShard | None, done: int) -> None:
        """Move the ``Trainer`` (its step, its data) to ``done`` steps; the engine is already there."""
        if loader is None:
            raise TrainerSetupError(
                "on_train_begin got no train_dataloader: LayerCheck cannot move the data to the resumed step"
            )
        if not hasattr(loader, "__len__"):
            raise TrainerSetupError(
                "LayerCheck resumes the Trainer's data by epoch and batch, which needs a train "
                "dataset with a length (a map-style datasets.Dataset or torch Dataset); an "
                "IterableDataset cannot be moved to the resumed step"
            )
        position = data_position(
            done, batches_per_epoch=len(loader), grad_accum=self.trainer.args.gradient_accumulation_steps
        )
        self._seek = DataSeek(loader, position)
        state.global_step = done
        state.epoch = self._seek.epoch_progress(0.0)
        # The Trainer's loss logging and throughput count from the step train() started at.
        for name in ("_globalstep_last_logged", "_initial_global_step"):
            if hasattr(self.trainer, name):
                setattr(self.trainer, name, done)
        logger.warning("Trainer resumed at step %d (epoch %.3f)", done + 1, state.epoch)

    def _loss_total(self) -> float:
        """The ``Trainer``'s running loss sum since its last log (its ``_tr_loss``); the step's loss
        is its growth over the step. NaN when a ``Trainer`` version keeps no such sum."""
        total = getattr(self.trainer, "_tr_loss", None)
        return float("nan") if total is None else float(total)


def trainer_tokenizer(trainer: Trainer) -> PreTrainedTokenizerBase | None:
    """The ``Trainer``'s tokenizer: its ``processing_class``, or a processor's tokenizer; ``None``
    where it has neither."""
    from transformers import PreTrainedTokenizerBase

    found = getattr(trainer, "processing_class", None)
    if found is not None and not isinstance(found, PreTrainedTokenizerBase):
        found = getattr(found, "tokenizer", None)  # a processor (text and images, say) holds one
    return found if isinstance(found, PreTrainedTokenizerBase) else None


def _rank_zero(trainer: Trainer) -> bool:
    check = getattr(trainer, "is_world_process_zero", None)
    if callable(check):
        return bool(check())
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def require_supported_engine(trainer: Trainer) -> None:
    """Raise :class:`TrainerSetupError` unless ``trainer`` is a ``Trainer`` set up for DeepSpeed
    (``TrainingArguments(deepspeed=...)``, or an Accelerate DeepSpeed plugin) or for FSDP2
    (``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})``, accelerate's ``is_fsdp2``); FSDP1,
    and an FSDP run accelerate turned into DDP (it shards only on GPUs), are named."""
    args = getattr(trainer, "args", None)
    if args is None or not hasattr(trainer, "model_wrapped"):
        raise TrainerSetupError(
            "LayerCheckCallback(trainer): pass the transformers.Trainer (or TRL SFTTrainer) "
            f"itself, got {type(trainer).__name__}"
        )
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        return
    if getattr(args, "fsdp", None):
        accelerator = getattr(trainer, "accelerator", None)
        if not getattr(trainer, "is_fsdp_enabled", False):
            raise TrainerSetupError(
                "the Trainer was asked for FSDP but accelerate runs it as "
                f"{getattr(getattr(accelerator, 'state', None), 'distributed_type', 'another kind')} (accelerate "
                "shards only on GPUs: on CPU FSDP falls back to DDP, which LayerCheck cannot checkpoint "
                "layer by layer); run it on GPUs, or use DeepSpeed (TrainingArguments(deepspeed=...))"
            )
        if not getattr(accelerator, "is_fsdp2", False):
            raise TrainerSetupError(
                "the Trainer runs FSDP1 (FullyShardedDataParallel), which LayerCheck does not map (transformers "
                'and torch deprecate it): set fsdp_config={"fsdp_version": 2}'
            )
        return
    raise TrainerSetupError(
        "LayerCheck needs the Trainer to run DeepSpeed or FSDP2: set TrainingArguments(deepspeed=...) "
        "(SFTConfig too) to a DeepSpeed config dict or JSON file path, ZeRO stage 0-3, with an "
        'optimizer ("optimizer": {"type": "AdamW", "params": {"lr": "auto"}} or '
        'the Trainer\'s own), or TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}) on GPUs'
    )


def runs_fsdp2(trainer: Trainer) -> bool:
    """Whether ``trainer`` trains under accelerate's FSDP2 (checked by :func:`require_supported_engine`)."""
    return bool(getattr(trainer, "is_fsdp_enabled", False)) and bool(
        getattr(getattr(trainer, "accelerator", None), "is_fsdp2", False)
    )


def fsdp2_parts(trainer: Trainer) -> tuple[torch.nn.Module, torch.optim.Optimizer, LRScheduler | None]:
    """The ``fully_shard`` model, the torch optimizer and scheduler a ``Trainer`` under FSDP2 trains
    with: accelerate wraps the optimizer (``AcceleratedOptimizer.optimizer``) and the scheduler
    (``AcceleratedScheduler.scheduler``), whose inner objects LayerCheck counts steps on and moves."""
    model = getattr(trainer, "model_wrapped", None) or trainer.model
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is None:
        raise TrainerSetupError("the Trainer has no optimizer yet: add LayerCheckCallback before trainer.train()")
    scheduler = getattr(trainer, "lr_scheduler", None)
    return (
        model,
        getattr(optimizer, "optimizer", optimizer),
        getattr(scheduler, "scheduler", scheduler) if scheduler is not None else None,
    )


def deepspeed_engine(trainer: Trainer) -> DeepSpeedEngine:
    """The ``DeepSpeedEngine`` the ``Trainer`` trains with (``model_wrapped`` once ``train()`` built it)."""
    engine = getattr(trainer, "model_wrapped", None)
    if engine is None or not hasattr(engine, "zero_optimization_stage"):
        raise TrainerSetupError(
            "the Trainer has no DeepSpeedEngine (trainer.model_wrapped is a "
            f"{type(engine).__name__}): set TrainingArguments(deepspeed=...) to a DeepSpeed "
            "config, and add LayerCheckCallback before trainer.train()"
        )
    return engine
