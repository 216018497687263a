"""The user's own methods of a DeepSpeed model run inside the engine's forward.

Under ZeRO-3 each rank holds a slice of every parameter, gathered by the engine's hooks
around the forward of each submodule: a method of the user's (``model.generate(...)``,
``model.features(x)``) meets the slices unless it runs inside the engine's forward. So the
set-up model's hook (``engines.EngineView._lite_method``) runs it there - the user's module's
``forward`` points at the method for that one call - always under ZeRO-3, and at stages 0-2
when gradients are on (the engine prepares its backward in forward); with gradients off at
stages 0-2 it is a plain call, on any ranks. Under ZeRO-3 such a call gathers: before it, the
ledger checks that every rank makes it (lockstep.py), and inside ``lite.join`` it is refused
(join/members.py), as is a method's result back-propagated there.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from scopedlite._strategies.join.members import in_join, refuse_backward_in_join, refuse_gather_in_join
from scopedlite._strategies.lockstep import Nesting, every_rank_calls
from scopedlite._strategies.method_results import on_backward

__all__ = ["method_running", "through_forward"]


def through_forward(
    face: torch.nn.Module,
    inner: torch.nn.Module,
    method: Callable[..., Any],
    qualified: str,
    nesting: Nesting | None,
    partitioned: bool,
) -> Callable[..., Any]:
    """``method`` (``inner``'s, called ``qualified`` in errors) as a callable that runs inside
    the engine's forward (a call of ``face``) when it needs to: always where the parameters
    are ``partitioned`` (ZeRO-3; ``nesting``: where its gathers are checked against the other
    ranks, None on one rank), otherwise when gradients are on."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if in_join(inner):  # ranks out of data replay forwards: a method is not one (join/members.py)
            if partitioned:
                refuse_gather_in_join(qualified)
            return on_backward(method(*args, **kwargs), functools.partial(refuse_backward_in_join, qualified))
        if not (partitioned or torch.is_grad_enabled()):
            return method(*args, **kwargs)
        with every_rank_calls(nesting, qualified):  # ZeRO-3 over several ranks
            return _run_through_forward(face, inner, method, args, kwargs)

    return call


def _not_traced(method: Callable[..., Any]) -> Callable[..., Any]:
    """A compiled model (``torch.compile``) traces its forward: not the user's method run in
    its place. (Nothing is compiled while torch's compiler was never imported.)"""
    return torch.compiler.disable(method) if "torch._dynamo" in sys.modules else method


# Set while one of the user's methods runs inside the engine's forward: the count of
# the user's training forwards (counted.py) does not count that call.
_METHOD_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("scopedlite_method_running", default=False)


def method_running() -> bool:
    """Whether the engine's forward under way runs one of the user's methods, not forward."""
    return _METHOD_RUNNING.get()


def _run_through_forward(
    face: torch.nn.Module, inner: torch.nn.Module, method: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Call ``method`` inside the engine's forward (``inner.forward`` points at it meanwhile)."""
    had_own_forward = "forward" in inner.__dict__
    own_forward = inner.__dict__.get("forward")

    def redirected(*a: Any, **k: Any) -> Any:
        _restore_forward(inner, had_own_forward, own_forward)  # the method may call forward
        out = method(*a, **k)
        # Wrappers' post-forward hooks look into outputs; a plain str or float has no
        # attributes to look into (ZeRO-3 calls vars() on it), so it travels boxed.
        return (
            out
            if out is None or isinstance(out, (torch.Tensor, list, tuple, dict)) or hasattr(out, "__dict__")
            else _Boxed(out)
        )

    inner.forward = _not_traced(redirected)  # type: ignore[method-assign]
    token = _METHOD_RUNNING.set(True)
    try:
        out = face(*args, **kwargs)
    finally:
        _METHOD_RUNNING.reset(token)
        _restore_forward(inner, had_own_forward, own_forward)
    return out.value if isinstance(out, _Boxed) else out


class _Boxed:
    """A method's result that is neither a tensor nor a container, through the engine's forward."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _restore_forward(inner: torch.nn.Module, had_own: bool, own: Any) -> None:
    if had_own:
        inner.forward = own  # type: ignore[method-assign]
    else:
        inner.__dict__.pop("forward", None)
