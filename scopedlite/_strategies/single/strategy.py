"""One process, one device: the strategy of a plain script and of every run outside launch."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch

from scopedlite._strategies.base import Rendezvous, Strategy
from scopedlite._strategies.join.collectives import NoJoin
from scopedlite._strategies.one_process import OneProcessCollectives
from scopedlite._strategies.scaler import GradientScaling, ScaledBackward

if TYPE_CHECKING:
    from scopedlite._core.run import Placement

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(ScaledBackward, OneProcessCollectives, Strategy):
    """Everything on one device in one process. Collectives return their input."""

    name: ClassVar[str] = "single"
    multi_process: ClassVar[bool] = False

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if world_size != 1:
            raise ValueError(
                f"strategy='single' runs one process, but the run asks for {world_size} "
                "(devices x num_nodes). Use strategy='ddp' for several, or devices=1."
            )

    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        self.place(placement)
        self.scaling = GradientScaling.for_placement(placement)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = self.placement.precision.convert_module(module.to(self.placement.device))
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.scaling.wrap_optimizer(optimizer, self.set_up)

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        return NoJoin()
