"""An in-place rank's process group formed when the user's loop first needs it
(orchestrator/runtime/deferred_group.py): a model build does not form it, the loop's first question
to torch does (``get_rank``, ``init_device_mesh`` through its own binding of ``is_initialized``),
other threads get torch's own answer, and torch's functions are back once it is formed. A real
gloo group of one rank in this process, destroyed after each test."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from layercheck.orchestrator.runtime import deferred_group


@pytest.fixture
def formed():
    """``form()`` for a pending group (a gloo group of one rank), and when it ran."""
    calls: list[str] = []

    def form() -> None:
        assert not dist.is_initialized()  # (torch's own answer inside the forming)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        calls.append(threading.current_thread().name)

    yield form, calls
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_loops_first_question_forms_the_group_and_a_model_build_does_not(formed):
    import importlib

    import torch.distributed.nn.functional

    form, calls = formed
    own = dist.is_initialized
    with deferred_group.pending(form) as group:
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=2)
        # a module that reads torch's group.WORLD as it is imported (transformers' model code imports
        # it as it builds a model): not a question
        importlib.reload(torch.distributed.nn.functional)
        elsewhere: list[bool] = []
        other = threading.Thread(target=lambda: elsewhere.append(dist.is_initialized()))
        other.start()
        other.join()
        assert calls == [] and elsewhere == [False]  # another thread is told what torch knows
        assert dist.get_rank() == 0 and dist.get_world_size() == 1
        assert calls == [threading.current_thread().name] and group.formed
        assert dist.is_initialized() and calls == [threading.current_thread().name]  # once
    assert dist.is_initialized is own and not hasattr(
        dist.distributed_c10d._get_default_group, "__layercheck_original__"
    )


def test_a_device_mesh_forms_the_group_through_its_own_binding_of_torchs_check(formed):
    from torch.distributed import device_mesh

    form, calls = formed
    with deferred_group.pending(form):
        mesh = device_mesh.init_device_mesh("cpu", (1,))
    assert calls and mesh.size() == 1
    assert not hasattr(device_mesh.is_initialized, "__layercheck_original__")


def test_torch_answers_as_ever_when_no_group_is_pending_and_after_a_failed_forming(formed):
    _, calls = formed

    def fails() -> None:
        raise TimeoutError("the others never came")

    assert not dist.is_initialized()
    with deferred_group.pending(fails), pytest.raises(TimeoutError, match="never came"):
        dist.is_initialized()
    assert not dist.is_initialized() and calls == []
    assert not hasattr(torch.distributed.is_initialized, "__layercheck_original__")
