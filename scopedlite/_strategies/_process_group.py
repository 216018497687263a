"""What every strategy over one torch.distributed process group shares: its collectives.

DDP, FSDP and DeepSpeed differ in how they wrap modules and optimizers, not in how our
collectives travel, so they inherit these four from one place. A strategy using it sets
``_backend`` and ``_comm_device`` in ``start`` (``_distributed.comm_device`` gives the device
tensors must be on to be sent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scopedlite import _distributed
from scopedlite._structures import map_tensors

if TYPE_CHECKING:
    from scopedlite._run import Run

__all__ = ["ProcessGroupCollectives"]


class ProcessGroupCollectives:
    """``all_reduce``, ``all_gather``, ``broadcast`` and ``barrier`` over the default group."""

    run: Run
    _backend: str
    _comm_device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return _distributed.all_reduce_tensor(tensor, op, self._comm_device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _distributed.all_gather_tensor(tensor, self._comm_device)

    def broadcast(self, obj: Any, src: int) -> Any:
        result = _distributed.broadcast_any(obj, src, self._comm_device)
        return map_tensors(result, lambda t: t.to(self.run.device))

    def barrier(self) -> None:
        _distributed.barrier(self._backend, self.run.device)
