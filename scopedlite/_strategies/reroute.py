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

import contextlib
import types
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch

from scopedlite._strategies.set_up import SetUpObjects

__all__ = ["StepRoute", "replace_method", "reroute_step"]


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


class StepRoute:
    """Whether the step that took over an optimizer's ``step()`` is running: while it is, a
    call of ``optimizer.step()`` (the scaler's, the engine's own) reaches the real step."""

    def __init__(self) -> None:
        self.inside = False

    @contextlib.contextmanager
    def taking(self) -> Iterator[None]:
        """Around a step taken by the scaler or engine itself, from any door (DeepSpeed's
        ``model.step()`` as well as the rerouted ``optimizer.step()``)."""
        before, self.inside = self.inside, True
        try:
            yield
        finally:
            self.inside = before


def reroute_step(
    optimizer: torch.optim.Optimizer, take_step: Callable[[], Any], closure_error: str, set_up: SetUpObjects
) -> StepRoute:
    """Make ``optimizer.step()`` call ``take_step()`` instead, for the run of ``set_up``.

    Args:
        optimizer: The user's optimizer, changed in place until the run ends.
        take_step: What a user's ``optimizer.step()`` does now; calls to ``optimizer.step``
            made while it runs reach the real step.
        closure_error: The message of the ``ValueError`` raised for ``step(closure)``, which
            cannot be honoured when someone else takes the step.
        set_up: The run's registry, which undoes the reroute when the run ends.

    Returns:
        The route: whether a step is being taken (for other rerouted methods), and how to take
        one from elsewhere.
    """
    original_step = optimizer.step
    route = StepRoute()

    def step(opt: torch.optim.Optimizer, closure: Any = None) -> Any:
        if route.inside:
            return original_step() if closure is None else original_step(closure)
        if closure is not None:
            raise ValueError(closure_error)
        with route.taking():
            return take_step()

    replace_method(optimizer, "step", step, set_up)
    return route
