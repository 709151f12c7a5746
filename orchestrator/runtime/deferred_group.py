"""The process group of an in-place rank's run of the user's loop (``CheckpointConfig(in_place=True)``),
formed when the loop first needs it rather than before the loop starts.

Why: whatever a loop does before it needs its group (its imports, its model build, its tokenizer)
then overlaps the wait for the other ranks. A survivor rebuilds its model while the lost rank's
replacement starts; a warm spare (``CheckpointConfig(spares=k)``) runs the loop that far before it
is promoted, and waits there for a rank.

How: torch answers "is there a default group?" in two functions, ``is_initialized`` and
``_get_default_group`` of ``torch.distributed.distributed_c10d`` (``get_rank``, every collective,
``deepspeed.initialize``, accelerate, ``init_device_mesh`` go through one of them; a few torch
modules bind them by name). While a group is pending (:func:`pending`), each binding is wrapped:
in the thread that runs the loop, and only there, the first call forms the group and then
answers as torch does. Once formed, torch's own functions are put back. Reading ``group.WORLD``
is not hooked: torch's modules read it at import, as default arguments.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: torch's functions that find the default group, wrapped while one is pending.
HOOKED = ("is_initialized", "_get_default_group")


class DeferredGroup:
    """A group to form (``form()``) the first time the loop's thread asks torch for it."""

    def __init__(self, form: Callable[[], None]) -> None:
        self._form = form
        self.thread = threading.get_ident()
        """The thread that runs the loop: other threads see torch's own answers."""
        self._forming = False
        self.formed = False

    def ensure(self) -> None:
        """Form the group, in the loop's thread, unless it is formed or being formed (the forming
        itself asks torch whether a group exists)."""
        if self.formed or self._forming or threading.get_ident() != self.thread:
            return
        self._forming = True
        try:
            self._form()
            self.formed = True
        finally:
            self._forming = False
        _unhook()  # torch's own functions from here on: nothing to form until the next pending group


_pending: DeferredGroup | None = None
_originals: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def pending(form: Callable[[], None]) -> Iterator[DeferredGroup]:
    """While inside, the calling thread's first question to torch about its default group forms it
    with ``form()`` (which must leave one formed). On the way out, torch's functions are restored."""
    global _pending
    group = DeferredGroup(form)
    with _lock:
        _pending = group
        _hook()
    try:
        yield group
    finally:
        with _lock:
            _pending = None
            _unhook()


def _gated(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def gated(*args: Any, **kwargs: Any) -> Any:
        group = _pending
        if group is not None:
            group.ensure()
        return original(*args, **kwargs)

    gated.__layercheck_original__ = original  # type: ignore[attr-defined]
    return gated


def _hook() -> None:
    """Wrap every binding of :data:`HOOKED` in the loaded modules (torch's own and any module that
    imported them by name); a module imported later that imports them from torch gets the wrapper."""
    from torch.distributed import distributed_c10d

    for name in HOOKED:
        original = getattr(distributed_c10d, name)
        original = getattr(original, "__layercheck_original__", original)
        _originals[name] = original
        _rebind(original, _gated(name, original), name)


def _unhook() -> None:
    with contextlib.suppress(RuntimeError):  # (a module imported meanwhile, in another thread)
        for name, original in _originals.items():
            _rebind(None, original, name)


def _rebind(current: Callable[..., Any] | None, new: Callable[..., Any], name: str) -> None:
    """Bind ``name`` to ``new`` in every loaded module where it is bound to ``current`` (``None``:
    to a wrapper of ours)."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        namespace = vars(module)
        bound = namespace.get(name)
        if bound is None or bound is new:
            continue
        ours = getattr(bound, "__layercheck_original__", None) is not None
        if (current is None and ours) or (current is not None and bound is current):
            namespace[name] = new
