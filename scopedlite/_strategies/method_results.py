"""Acting when (and only if) the result of a user's method is back-propagated.

A method's result that needs a gradient is passed through one identity ``autograd.Function``
over all its tensors. Its backward runs once, at the start of the backward through that
result and before any gradient reaches a parameter the method used (every path from those
parameters to the loss goes through it), which is where a strategy prepares, or refuses, what
the backward needs. A result that is never back-propagated costs nothing more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from scopedlite._core.structures import map_tensors

__all__ = ["on_backward"]


def on_backward(result: Any, action: Callable[[list[torch.Tensor]], None], keep_tensors: bool = False) -> Any:
    """``result`` with ``action(tensors)`` run when a backward through it starts.

    ``tensors`` are the result's tensors computed with gradients (not leaves such as a
    parameter, which are left as they are), as the method returned them, if
    ``keep_tensors`` (they stay alive until then), else an empty list. Returns ``result``
    itself when it holds no such tensor.
    """
    tensors: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        if _computed(tensor):
            tensors.append(tensor)
        return tensor

    _map(result, collect)
    if not tensors:
        return result
    wrapped = iter(_OnBackward.apply(_Pending(action, tensors if keep_tensors else []), *tensors))
    return _map(result, lambda t: next(wrapped) if _computed(t) else t)


def _map(result: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``map_tensors``, and into the fields of a dataclass (set on the object returned)."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        for field in dataclasses.fields(result):
            value = getattr(result, field.name, None)
            changed = map_tensors(value, fn)
            if changed is not value:
                object.__setattr__(result, field.name, changed)
        return result
    return map_tensors(result, fn)


def _computed(tensor: torch.Tensor) -> bool:
    """Computed with gradients (a parameter or other leaf is returned as it is: the object)."""
    return tensor.requires_grad and tensor.grad_fn is not None


class _Pending:
    """The action and the tensors it is handed, dropped once the action has run."""

    def __init__(self, action: Callable[[list[torch.Tensor]], None], tensors: list[torch.Tensor]) -> None:
        self.action: Callable[[list[torch.Tensor]], None] | None = action
        self.tensors = tensors

    def run(self) -> None:
        action, tensors = self.action, self.tensors
        self.action, self.tensors = None, []
        if action is not None:
            action(tensors)


class _OnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pending: _Pending, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.pending = pending
        # Outputs the loss did not use get no gradient and stay so: like DDP's own output
        # identity, their parameters' hooks still fire, with no gradient.
        ctx.set_materialize_grads(False)
        # Copies, not views: a view made here could not be modified in place (`loss /= n`).
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        ctx.pending.run()
        return (None, *grads)
