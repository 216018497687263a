"""One process, one device: the strategy of a plain script and of every run outside launch."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch

from scopedlite._strategies._base import Rendezvous, ReduceOp, Strategy
from scopedlite._strategies._scaler import GradientScaling

if TYPE_CHECKING:
    from scopedlite._run import Run

__all__ = ["OneProcessCollectives", "SingleDeviceStrategy"]


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


class SingleDeviceStrategy(OneProcessCollectives, Strategy):
    """Everything on one device in one process. Collectives return their input."""

    name: ClassVar[str] = "single"
    multi_process: ClassVar[bool] = False

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if world_size != 1:
            raise ValueError(
                f"strategy='single' runs one process, but the run asks for {world_size} "
                "(devices x num_nodes). Use strategy='ddp' for several, or devices=1."
            )

    def start(self, run: Run, rendezvous: Rendezvous | None) -> None:
        self.run = run
        self.scaling = GradientScaling.for_run(run)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = self.run.precision.convert_module(module.to(self.run.device))
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.scaling.wrap_optimizer(optimizer)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.scaling.scale(loss).backward(*args, **kwargs)

    def clip_gradients(self, module, optimizer, max_norm, clip_val):  # type: ignore[no-untyped-def]
        self.scaling.unscale(optimizer)
        return super().clip_gradients(module, optimizer, max_norm, clip_val)

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        from scopedlite._join_session import NoJoin

        return NoJoin()
