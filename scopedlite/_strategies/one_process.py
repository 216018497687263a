"""The collectives of a strategy that runs in one process: the identity."""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._strategies.base import ReduceOp

__all__ = ["OneProcessCollectives"]


class OneProcessCollectives:
    """Collectives of a one-process strategy: the identity.

    The front end never calls these (it answers for one process itself); they exist so the
    strategy fulfils the interface.
    """

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)

    def broadcast(self, obj: Any, src: int) -> Any:
        return obj

    def barrier(self) -> None:
        return None
