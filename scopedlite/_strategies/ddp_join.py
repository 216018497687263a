"""The DDP side of ``lite.join``: hooks and replays for the replay session (see replay.py).

DDP joins the same way as the sharded strategies: a rank out of data replays each forward on
a cached input and each backward with zero output gradients, so it takes part in DDP's own
collectives (the gradient all-reduce, the unused-parameter search, buffer broadcasts, bucket
rebuilds) exactly as the active ranks do, contributing zeros, and steps its optimizer with the
averaged gradients like everyone else. This replaces torch's ``Join``, whose joined ranks
shadow the backward all-reduce at forward time: a user collective between forward and backward
then meets that all-reduce and the run aborts.

- DDP decides at forward time whether the backward syncs (``require_backward_grad_sync``,
  which ``no_sync`` clears): the forward announcement carries it, and a joined rank replays
  under ``no_sync`` when the active ranks did.
- ``divide_by_initial_world_size=False``: DDP always averages over the world, so the active
  ranks' output gradients are scaled by ``world_size / active`` in the backward announcement.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite._strategies.replay import announce_forwards

if TYPE_CHECKING:
    from scopedlite._strategies.replay import ReplayJoin

__all__ = ["DDPReplay"]


class DDPReplay:
    """Hooks and replays of DDP models for :class:`~scopedlite._strategies.replay.ReplayJoin`."""

    records_steps = True

    def __init__(self, strategy: Any, models: tuple[DistributedDataParallel, ...], divide_by_initial_world_size: bool, world_size: int) -> None:
        self.strategy = strategy
        self.models = models
        self.divide = divide_by_initial_world_size
        self.world_size = world_size

    def install(self, session: ReplayJoin) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for index, model in enumerate(self.models):
            announce_forwards(stack, session, index, model)
        return stack

    def forward(self, index: int, args: Any, kwargs: Any, sync: bool) -> Any:
        model = self.models[index]
        with model.no_sync() if not sync else contextlib.nullcontext():
            return model(*args, **kwargs)

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool) -> None:
        if outputs:
            torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])

    def step(self, index: int) -> None:
        raise AssertionError("DDP's optimizer step is local: it travels as an event")

    def sync_flag(self, index: int) -> bool:
        return bool(self.models[index].require_backward_grad_sync)

    def output_scale(self, count: int) -> float:
        return 1.0 if self.divide else self.world_size / count

    def active_count(self, count: int) -> None:
        pass  # output_scale reads the count

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None, clip_val: float | None, norm_type: float) -> Any:
        return self.strategy.clip_gradients(self.models[0], optimizer, max_norm, clip_val, norm_type=norm_type)


def refuse_what_join_cannot_replay(
    models: tuple[Any, ...], modules: tuple[DistributedDataParallel, ...], optimizers: tuple[torch.optim.Optimizer, ...]
) -> None:
    """Raise, before the loop starts, for what a joined rank cannot mirror."""
    from torch.distributed.optim import (
        ZeroRedundancyOptimizer,  # lazy: ~0.25 s to import
    )

    for model in models:
        if not any(model is m for m in modules):
            raise TypeError(
                f"lite.join takes the models returned by lite.setup, got a {type(model).__name__} "
                "that was not set up in this run. Use `model = lite.setup(model)` and then "
                "`with lite.join(model):`."
            )
        if getattr(model, "static_graph", False):
            raise ValueError(
                "lite.join cannot be used with DDP's static_graph=True: with uneven inputs "
                "torch aborts the process (gloo SIGABRT) when a rank has no batch or unused "
                "parameters are searched. Use lite.DDPStrategy(static_graph=False) for runs "
                "with uneven inputs."
            )
    for optimizer in optimizers:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise ValueError(  # noqa: TRY004 (a valid optimizer, one join cannot mirror)
                "lite.join cannot be used with torch's ZeroRedundancyOptimizer: its step "
                "broadcasts each rank's shard, a collective a rank that ran out of data cannot "
                "mirror in step (torch's own join hook steps it with stale gradients instead, "
                "ending with identical but wrong parameters). Use a plain optimizer under "
                "strategy='ddp', or shard optimizer state with strategy='fsdp' / 'deepspeed'."
            )
