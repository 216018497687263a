"""``lite.no_backward_sync``: skip gradient synchronisation during accumulation steps."""

from __future__ import annotations

from typing import Any, ContextManager

import torch

from scopedlite._api.current import current
from scopedlite._core.scope import WrapperScope
from scopedlite._strategies.abilities import SupportsNoBackwardSync

__all__ = ["no_backward_sync"]


class _NoBackwardSync(WrapperScope[None]):
    def __init__(self, module: torch.nn.Module, enabled: bool) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"no_backward_sync takes the model returned by lite.setup, got {type(module).__name__}.")
        self.module, self.enabled = module, bool(enabled)

    def describe(self) -> str:
        return f"lite.no_backward_sync({type(self.module).__name__}, enabled={self.enabled})"

    def _inner_context(self) -> tuple[ContextManager[Any], None]:
        strategy = current().strategy
        if not isinstance(strategy, SupportsNoBackwardSync):
            raise RuntimeError(
                f"strategy={strategy.name!r} cannot skip gradient synchronisation; remove "
                "lite.no_backward_sync or choose strategy='ddp'."
            )
        return strategy.no_backward_sync(self.module, self.enabled), None


def no_backward_sync(module: torch.nn.Module, enabled: bool = True) -> _NoBackwardSync:
    """Accumulate gradients locally inside the block; the next backward outside syncs them.

    ``enabled=False`` syncs as usual, so the same line serves every step::

        with lite.no_backward_sync(model, enabled=not is_last_micro_batch):
            lite.backward(loss)
    """
    return _NoBackwardSync(module, enabled)
