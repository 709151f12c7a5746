"""LayerCheckCallback without Ray or DeepSpeed: its step bookkeeping against a scripted
attachment, the data position it moves a real Hugging Face ``Trainer`` to on a restart (the
batches after the restart are the failure-free run's, across epochs, with gradient accumulation),
and the errors a misconfigured ``Trainer`` gets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

import layercheck
from layercheck import hf
from layercheck.hf import LayerCheckCallback, TrainerSetupError
from layercheck.hf_position import DataSeek, data_position


class FakeAttachment:
    """What ``layercheck.attach`` returns, scripted: where to start, and what it was told."""

    def __init__(self, start_step: int) -> None:
        self.start_step = start_step
        self.steps: list[tuple[int, float]] = []
        self.finished = 0

    def after_step(self, step: int, *, loss: float) -> None:
        self.steps.append((step, loss))

    def check_steps(self, total_steps: int) -> list[str]:
        return []

    def finish(self) -> None:
        self.finished += 1


class FakeLoader:
    def __init__(self, batches: int) -> None:
        self.batches, self.skip_batches, self.iteration, self.epochs = batches, 0, 0, []

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        self.epochs.append(epoch)


def fake_trainer(grad_accum: int = 1) -> Any:
    args = SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}}, gradient_accumulation_steps=grad_accum)
    return SimpleNamespace(args=args, model_wrapped=None, _tr_loss=torch.tensor(0.0), _globalstep_last_logged=0)


def test_data_position_counts_steps_as_the_trainer_does():
    assert data_position(0, batches_per_epoch=6, grad_accum=1) == hf.data_position(0, batches_per_epoch=6, grad_accum=1)
    p = data_position(7, batches_per_epoch=6, grad_accum=1)
    assert (p.epochs_done, p.batches_to_skip, p.exact) == (1, 1, True)
    p = data_position(4, batches_per_epoch=6, grad_accum=2)  # 3 steps per epoch
    assert (p.epochs_done, p.batches_to_skip, p.exact) == (1, 2, True)
    p = data_position(2, batches_per_epoch=7, grad_accum=2)  # 4 steps per epoch, the last takes one batch
    assert (p.epochs_done, p.batches_to_skip, p.exact) == (0, 4, False)
    with pytest.raises(ValueError, match="grad_accum"):
        data_position(1, batches_per_epoch=6, grad_accum=0)


def test_callback_reports_each_step_with_its_loss_and_finishes():
    trainer = fake_trainer()
    attachment = FakeAttachment(start_step=1)
    cb = LayerCheckCallback(trainer, attach=lambda t: attachment)
    state, loader = transformers.TrainerState(), FakeLoader(6)
    cb.on_train_begin(trainer.args, state, None, train_dataloader=loader)
    for step, loss in enumerate([2.5, 2.0, 1.5], start=1):
        cb.on_step_begin(trainer.args, state, None)
        trainer._tr_loss += loss
        state.global_step = step
        cb.on_step_end(trainer.args, state, None)
    cb.on_train_end(trainer.args, state, None)
    assert attachment.steps == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert attachment.finished == 1
    assert loader.skip_batches == 0 and state.global_step == 3


def test_callback_moves_a_restarted_trainer_to_t_fail():
    trainer = fake_trainer()
    cb = LayerCheckCallback(trainer, attach=lambda t: FakeAttachment(start_step=8))
    state, loader = transformers.TrainerState(), FakeLoader(6)
    cb.on_train_begin(trainer.args, state, None, train_dataloader=loader)
    assert state.global_step == 7 and trainer._globalstep_last_logged == 7
    assert state.epoch == pytest.approx(7 / 6)
    assert loader.skip_batches == 1  # step 7 was epoch 1's first batch
    loader.set_epoch(0)  # the Trainer starts its epochs at 0 ...
    assert loader.epochs == [1] and loader.iteration == 0  # ... the shuffle is epoch 1's
    cb.on_epoch_end(trainer.args, state, None)
    assert loader.skip_batches == 0


def test_callback_refuses_a_trainer_resumed_from_its_own_checkpoint():
    trainer = fake_trainer()
    cb = LayerCheckCallback(trainer, attach=lambda t: FakeAttachment(start_step=1))
    state = transformers.TrainerState(global_step=5)
    with pytest.raises(TrainerSetupError, match="resume_from_checkpoint"):
        cb.on_train_begin(trainer.args, state, None, train_dataloader=FakeLoader(6))


def test_a_loader_without_skip_batches_is_refused():
    with pytest.raises(TypeError, match="skip_batches"):
        DataSeek(torch.utils.data.DataLoader(list(range(4))), data_position(1, batches_per_epoch=4, grad_accum=1))


class TinyLM(torch.nn.Module):
    """A model that records the rows it is fed (their first token is the row's index)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Embedding(64, 1)
        self.seen: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.seen.append(input_ids[:, 0].tolist())
        return {"loss": self.w(input_ids).pow(2).mean()}


def run_trainer(
    tmp_path, *, start_step: int, steps: int, grad_accum: int, epochs: int = 0
) -> tuple[list[list[int]], list, list]:
    """A real ``Trainer`` (shuffled data, 6 batches of 2 per epoch) with the callback; the rows
    each micro-batch held, the steps reported, ``state.epoch`` at each step."""
    torch.manual_seed(0)
    model = TinyLM()
    rows = [{"input_ids": [i, i + 1, i + 2], "labels": [i, i + 1, i + 2]} for i in range(12)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"out{start_step}"),
        use_cpu=True,
        max_steps=steps if not epochs else -1,
        num_train_epochs=epochs or 3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=grad_accum,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=3,
        dataloader_num_workers=0,
        logging_steps=1,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    attachment = FakeAttachment(start_step)
    epochs: list[float] = []

    class EpochLog(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            epochs.append(state.epoch)

    trainer.add_callback(LayerCheckCallback(trainer, attach=lambda t: attachment))
    trainer.add_callback(EpochLog())
    trainer.train()
    assert attachment.finished == 1
    return model.seen, attachment.steps, epochs


@pytest.fixture
def no_deepspeed_check(monkeypatch):
    """The data tests use a real Trainer without DeepSpeed (the engine is scripted away)."""
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (the test extra)")
    monkeypatch.setattr(hf, "require_supported_engine", lambda trainer: None)


@pytest.mark.parametrize("grad_accum,start_step", [(1, 4), (1, 8), (1, 13), (2, 3), (2, 5)])
def test_a_restarted_trainer_sees_the_failure_free_batches(tmp_path, no_deepspeed_check, grad_accum, start_step):
    steps = 15 if grad_accum == 1 else 8
    full, full_steps, full_epochs = run_trainer(tmp_path, start_step=1, steps=steps, grad_accum=grad_accum)
    resumed, resumed_steps, resumed_epochs = run_trainer(
        tmp_path, start_step=start_step, steps=steps, grad_accum=grad_accum
    )
    assert [s for s, _ in full_steps] == list(range(1, steps + 1))
    assert [s for s, _ in resumed_steps] == list(range(start_step, steps + 1))
    assert resumed == full[(start_step - 1) * grad_accum :]  # the same rows, in the same order
    assert resumed_epochs == pytest.approx(full_epochs[start_step - 1 :])
    assert len({tuple(b) for b in full}) > 6  # the epochs are shuffled differently (else the test shows little)


def test_an_epoch_bounded_run_resumes_and_ends_where_the_failure_free_run_ends(tmp_path, no_deepspeed_check):
    full, full_steps, _ = run_trainer(tmp_path, start_step=1, steps=0, grad_accum=1, epochs=3)
    resumed, resumed_steps, _ = run_trainer(tmp_path, start_step=8, steps=0, grad_accum=1, epochs=3)
    assert [s for s, _ in full_steps] == list(range(1, 19))
    assert [s for s, _ in resumed_steps] == list(range(8, 19))
    assert resumed == full[7:]


def test_a_trainer_without_deepspeed_is_refused_with_what_to_set(tmp_path):
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (the test extra)")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=TinyLM(), args=args, train_dataset=[{"input_ids": [1, 2]}])
    with pytest.raises(TrainerSetupError, match=r"TrainingArguments\(deepspeed=\.\.\.\)"):
        LayerCheckCallback(trainer)
    with pytest.raises(TrainerSetupError, match="pass the transformers.Trainer"):
        LayerCheckCallback(object())
    assert layercheck.LayerCheckCallback is LayerCheckCallback


def test_no_deepspeed_is_refused_before_training_with_what_to_set():
    no_ds = SimpleNamespace(args=SimpleNamespace(deepspeed=None, gradient_accumulation_steps=1), model_wrapped=None)
    with pytest.raises(TrainerSetupError, match=r"TrainingArguments\(deepspeed=\.\.\.\)"):
        LayerCheckCallback(no_ds)
    trainer = fake_trainer()  # says DeepSpeed, but train() built no engine
    trainer.model_wrapped = torch.nn.Linear(2, 2)
    cb = LayerCheckCallback(trainer)
    with pytest.raises(TrainerSetupError, match="has no DeepSpeedEngine .*Linear"):
        cb.on_train_begin(trainer.args, transformers.TrainerState(), None, train_dataloader=FakeLoader(2))


def test_a_restart_over_an_iterable_dataset_is_refused_naming_it():
    trainer = fake_trainer()
    cb = LayerCheckCallback(trainer, attach=lambda t: FakeAttachment(start_step=3))
    with pytest.raises(TrainerSetupError, match="IterableDataset"):
        cb.on_train_begin(trainer.args, transformers.TrainerState(), None, train_dataloader=iter([]))


def test_a_trainer_asked_for_fsdp_on_cpu_is_refused_as_the_ddp_it_fell_back_to():
    """accelerate shards only on GPUs: a distributed Trainer given fsdp=... on CPU runs DDP
    (``MULTI_CPU``; a lone process refuses fsdp itself), which LayerCheck says before training."""
    fell_back = SimpleNamespace(
        args=SimpleNamespace(deepspeed=None, fsdp="full_shard", gradient_accumulation_steps=1),
        model_wrapped=None,
        is_fsdp_enabled=False,
        accelerator=SimpleNamespace(is_fsdp2=False, state=SimpleNamespace(distributed_type="MULTI_CPU")),
    )
    with pytest.raises(TrainerSetupError, match=r"asked for FSDP but accelerate runs it as MULTI_CPU .*DDP"):
        LayerCheckCallback(fell_back)


def test_fsdp1_is_refused_and_fsdp2s_parts_are_the_wrapped_optimizer_and_scheduler():
    """A Trainer under accelerate's FSDP (what a GPU run gives): FSDP1 refused; under FSDP2 the
    callback attaches to the model with the optimizer and scheduler inside accelerate's wrappers."""
    from layercheck.hf import fsdp2_parts, runs_fsdp2

    def fsdp_trainer(version: int) -> SimpleNamespace:
        model = torch.nn.Linear(2, 2)
        inner = torch.optim.AdamW(model.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0)
        return SimpleNamespace(
            args=SimpleNamespace(deepspeed=None, fsdp="full_shard", gradient_accumulation_steps=1),
            model_wrapped=model,
            model=model,
            is_fsdp_enabled=True,
            accelerator=SimpleNamespace(is_fsdp2=version == 2),
            optimizer=SimpleNamespace(optimizer=inner),  # accelerate's AcceleratedOptimizer
            lr_scheduler=SimpleNamespace(scheduler=schedule),  # its AcceleratedScheduler
        )

    with pytest.raises(TrainerSetupError, match=r"runs FSDP1 .*fsdp_version.: 2"):
        LayerCheckCallback(fsdp_trainer(1))
    trainer = fsdp_trainer(2)
    LayerCheckCallback(trainer)
    assert runs_fsdp2(trainer)
    model, optimizer, scheduler = fsdp2_parts(trainer)
    assert model is trainer.model_wrapped
    assert optimizer is trainer.optimizer.optimizer and scheduler is trainer.lr_scheduler.scheduler
