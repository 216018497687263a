"""What every strategy over one torch.distributed process group shares.

DDP, FSDP and DeepSpeed differ in how they wrap modules and optimizers, not in how their
processes meet or how our collectives travel: the backend option and its checks, the start
(bind the GPU, create the group) and stop, and the four collectives live here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scopedlite._cluster.environments import EXISTING_GROUP
from scopedlite._comm import process_group as _distributed
from scopedlite._core.structures import map_tensors
from scopedlite._strategies.base import Rendezvous, Strategy

if TYPE_CHECKING:
    from scopedlite._core.run import Placement

__all__ = ["ProcessGroupStrategy"]

_BACKENDS = (None, "gloo", "nccl")
_START_METHODS = (None, "script", "fork")


class ProcessGroupStrategy(Strategy):
    """A strategy whose ranks share the default process group.

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks NCCL on CUDA, else gloo.
        start_method: How our launcher starts the other local processes when
            ``launch(launcher="auto")``: ``"script"`` re-executes the command line,
            ``"fork"`` forks (notebooks). None picks by where the code runs.
    """

    def __init__(self, process_group_backend: str | None = None, start_method: str | None = None) -> None:
        if process_group_backend not in _BACKENDS:
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is not valid; choose "
                "'gloo', 'nccl' or None."
            )
        if start_method not in _START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not valid; choose one of "
                f"{_START_METHODS[1:]} or None."
            )
        self.process_group_backend = process_group_backend
        self.start_method = start_method

    @property
    def launcher(self) -> str | None:  # type: ignore[override]
        return self.start_method

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if self.process_group_backend == "nccl" and accelerator != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs accelerator='cuda', not {accelerator!r}; "
                "use 'gloo' (or None) on CPU."
            )

    def backend(self, accelerator: str) -> str:
        return self.process_group_backend or super().backend(accelerator)

    @property
    def comm_device(self) -> torch.device:
        return self._comm_device

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        """Bind this process's GPU (if any) and create the run's process group, or join the
        default group that existed before launch."""
        assert rendezvous is not None, f"strategy={self.name!r} needs a rendezvous"
        self.placement = placement
        existing = rendezvous.world.source == EXISTING_GROUP  # made before launch: joined, kept
        if existing:
            self._backend = _distributed.adopt_existing_group(rendezvous.world, self.process_group_backend, placement.accelerator)
        else:
            self._backend = self.backend(placement.accelerator)
        self._comm_device = _distributed.comm_device(self._backend, placement.device)
        if placement.accelerator == "cuda":
            torch.cuda.set_device(placement.device)
        if not existing:
            _distributed.init_process_group(
                self._backend, rendezvous.world, timeout=placement.timeout, store=rendezvous.store, device=placement.device
            )

    def stop(self) -> None:
        _distributed.destroy_process_group()

    # -- collectives over the default group ---------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return _distributed.all_reduce_tensor(tensor, op, self._comm_device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _distributed.all_gather_tensor(tensor, self._comm_device)

    def broadcast(self, obj: Any, src: int) -> Any:
        result = _distributed.broadcast_any(obj, src, self._comm_device)
        return map_tensors(result, lambda t: t.to(self.placement.device))

    def barrier(self) -> None:
        _distributed.barrier(self._backend, self.placement.device)
