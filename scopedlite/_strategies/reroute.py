"""Rerouting an optimizer's methods on the instance, for strategies that must own the step.

Users keep calling ``optimizer.step()`` on the optimizer ``setup`` returned. When a loss
scaler or an engine must take the step instead, the call is rerouted on the instance (not
wrapped in another object), so the optimizer stays an instance of its own class and LR
schedulers built on it keep working. The scaler or engine then calls ``optimizer.step()``
itself: that inner call reaches the optimizer's real step.

The optimizer is the user's: each reroute lasts for the run only. The run's registry
(``set_up.py``) gives the optimizer its own methods back when the run ends, so an optimizer set
up again in a later launch block is rerouted from its own step, not from a rerouted one.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

import torch

from scopedlite._strategies.set_up import SetUpObjects

__all__ = ["replace_method", "reroute_step"]


def replace_method(
    optimizer: torch.optim.Optimizer, name: str, function: Callable[..., Any], set_up: SetUpObjects
) -> None:
    """Make ``optimizer.<name>`` call ``function(optimizer, ...)`` until the run of ``set_up``
    ends; then the attribute the instance had before (usually none: its class's method) is back.

    A bound method, as LR schedulers require of ``step``. The undo holds the optimizer weakly:
    an optimizer (and its parameters: under DeepSpeed the engine's) that the user drops during
    the run is freed."""
    # What the instance had is kept by the undo, for the run (usually nothing: _NONE).
    before = vars(optimizer).get(name, _NONE)
    ours = types.MethodType(function, optimizer)
    setattr(optimizer, name, ours)
    held, rerouted = weakref.ref(optimizer), weakref.ref(ours)
    del ours

    def undo() -> None:
        optimizer, ours = held(), rerouted()
        if optimizer is None or ours is None or vars(optimizer).get(name) is not ours:
            return  # freed, or replaced again since by someone else: theirs stays
        if before is _NONE:
            delattr(optimizer, name)
        else:
            setattr(optimizer, name, before)

    set_up.at_end(undo)


_NONE = object()  # the instance had no attribute of that name (its class's method applied)


def reroute_step(
    optimizer: torch.optim.Optimizer, take_step: Callable[[], Any], closure_error: str, set_up: SetUpObjects
) -> Callable[[], bool]:
    """Make ``optimizer.step()`` call ``take_step()`` instead, for the run of ``set_up``.

    Args:
        optimizer: The user's optimizer, changed in place until the run ends.
        take_step: What a user's ``optimizer.step()`` does now; calls to ``optimizer.step``
            made while it runs reach the real step.
        closure_error: The message of the ``ValueError`` raised for ``step(closure)``, which
            cannot be honoured when someone else takes the step.
        set_up: The run's registry, which undoes the reroute when the run ends.

    Returns:
        A function telling whether ``take_step`` is running (for other rerouted methods).
    """
    original_step = optimizer.step
    inside = [False]

    def step(opt: torch.optim.Optimizer, closure: Any = None) -> Any:
        if inside[0]:
            return original_step() if closure is None else original_step(closure)
        if closure is not None:
            raise ValueError(closure_error)
        inside[0] = True
        try:
            return take_step()
        finally:
            inside[0] = False

    replace_method(optimizer, "step", step, set_up)
    return lambda: inside[0]
