"""Rerouting ``optimizer.step()`` on the instance, for strategies that must own the step.

Users keep calling ``optimizer.step()`` on the optimizer ``setup`` returned. When a loss
scaler or an engine must take the step instead, the call is rerouted on the instance (not
wrapped in another object), so the optimizer stays an instance of its own class and LR
schedulers built on it keep working. The scaler or engine then calls ``optimizer.step()``
itself: that inner call reaches the optimizer's real step.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

__all__ = ["reroute_step"]


def reroute_step(
    optimizer: torch.optim.Optimizer, take_step: Callable[[], Any], closure_error: str
) -> Callable[[], bool]:
    """Make ``optimizer.step()`` call ``take_step()`` instead.

    Args:
        optimizer: The user's optimizer, changed in place.
        take_step: What a user's ``optimizer.step()`` does now; calls to ``optimizer.step``
            made while it runs reach the real step.
        closure_error: The message of the ``ValueError`` raised for ``step(closure)``, which
            cannot be honoured when someone else takes the step.

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

    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    return lambda: inside[0]
