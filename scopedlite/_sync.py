"""``lite.no_backward_sync``: skip gradient synchronisation during accumulation steps."""

from __future__ import annotations

import contextvars
from types import TracebackType
from typing import Any

import torch

from scopedlite._run import current
from scopedlite._scope import Scope
from scopedlite._strategies._base import SupportsNoBackwardSync

__all__ = ["no_backward_sync"]

_sync_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.no_backward_sync", default=None)


class _NoBackwardSync(Scope[None]):
    _var = _sync_var

    def __init__(self, module: torch.nn.Module, enabled: bool) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"no_backward_sync takes the model returned by lite.setup, got {type(module).__name__}.")
        self.module, self.enabled = module, bool(enabled)

    def describe(self) -> str:
        return f"lite.no_backward_sync({type(self.module).__name__}, enabled={self.enabled})"

    def _enter(self) -> None:
        strategy = current().strategy
        if not isinstance(strategy, SupportsNoBackwardSync):
            raise RuntimeError(
                f"strategy={strategy.name!r} cannot skip gradient synchronisation; remove "
                "lite.no_backward_sync or choose strategy='ddp'."
            )
        self._inner = strategy.no_backward_sync(self.module, self.enabled)
        self._inner.__enter__()

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._inner.__exit__(exc_type, exc, tb)
        return None


def no_backward_sync(module: torch.nn.Module, enabled: bool = True) -> _NoBackwardSync:
    """Accumulate gradients locally inside the block; the next backward outside syncs them.

    ``enabled=False`` syncs as usual, so the same line serves every step::

        with lite.no_backward_sync(model, enabled=not is_last_micro_batch):
            lite.backward(loss)
    """
    return _NoBackwardSync(module, enabled)
