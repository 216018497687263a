"""The set-up DDP model: torch's ``DistributedDataParallel`` answering for the user's module.

``lite.setup`` builds the DDP module and swaps its class for :class:`SetUpDDP`
(``user_model.present_as_user_model``): :class:`~scopedlite._strategies.user_model.UserModelView`
mixed in before DDP's class, with DDP's hook for the user's methods (ddp/methods.py) and
DDP's forward, ``join_hook`` and ``register_comm_hook`` kept in step with the ranks' checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite._private.torch_internals import ddp_comm_hook
from scopedlite._strategies.ddp.counted import count_of, paused_in_torch_join, use_hook
from scopedlite._strategies.ddp.methods import ddp_method
from scopedlite._strategies.ddp.unused import forward_naming_unused
from scopedlite._strategies.user_model import UserModelView

__all__ = ["SetUpDDP"]


class SetUpDDP(UserModelView, DistributedDataParallel):
    """``DistributedDataParallel`` answering for the user's module (``user_model.py``'s view)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """DDP's forward; its error for parameters the last backward left without a
        gradient names them and our fixing line (ddp/unused.py). A training forward is
        counted, for the ranks to compare at the next backward (ddp/counted.py)."""
        if torch.is_grad_enabled():
            count = count_of(ddp_comm_hook(self))
            if count is not None:
                count.forward()
        return forward_naming_unused(self, *args, **kwargs)

    def _lite_method(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        return ddp_method(self, self._lite_module(), method, name)

    def join_hook(self, **kwargs: Any) -> Any:
        """torch's ``Join([model])``: DDP's own hook, with the ranks' comparison of their
        training forwards paused for the block (ddp/counted.py), where a rank out of data
        shadows the others' backwards after fewer forwards."""
        return paused_in_torch_join(super().join_hook(**kwargs), self)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Your hook reduces the gradient buckets; inside the set-up model's own hook, which
        still has the ranks compare their backwards (ddp/counted.py)."""
        if not use_hook(ddp_comm_hook(self), state, hook):
            super().register_comm_hook(state, hook)
