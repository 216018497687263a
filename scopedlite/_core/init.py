"""Building modules in place: on the run's device, and optionally without initialising them."""

from __future__ import annotations

from typing import Any, ContextManager

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["on_device", "skip_init"]


def on_device(device: torch.device) -> ContextManager[Any]:
    """Create tensors on ``device`` by default (torch's own device context manager)."""
    return device  # torch.device is a context manager since torch 2.0


class skip_init(TorchFunctionMode):
    """Skip ``torch.nn.init`` calls, leaving parameters allocated but uninitialised.

    For models whose weights are about to be loaded from a checkpoint: initialising a large
    model only to overwrite it costs minutes. Memory is still allocated on the device.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)
