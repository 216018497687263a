"""The DDP side of ``lite.join``: hooks and replays for the session (see join/session.py).

A serving rank replays each forward on a cached input and each backward with zero output
gradients, so it takes part in DDP's own collectives (the gradient all-reduce, the
unused-parameter search, bucket rebuilds) as the running ranks do, and steps its optimizer
with the averaged gradients like everyone else. The result is that of torch's own ``Join``
over DDP, which the tests check scenario by scenario:

- **A serving rank contributes zero.** Before a synchronised replayed backward its gradients
  are set aside, so whatever it holds (the average of the last step, which a module's own
  ``zero_grad()`` or ``param.grad = None`` on the running ranks cleared there) adds nothing;
  parameters the all-reduce does not reach get theirs back. Two things it holds are
  contributed: the micro-batches it ran itself inside ``no_backward_sync`` before running out,
  at the first synchronised backward after; and, where the running ranks hold gradients
  before a backward (an accumulation window whose backwards all synchronise: DDP all-reduces
  ``param.grad`` as accumulated, so each rank must bring the window's average again), the
  same average it holds, which is exact where torch's ``Join`` contributes zero.
- **Buffers come from the highest running rank** before each forward that syncs them, as
  under torch's ``Join`` (DDP alone takes rank 0's, which may have left): the broadcast at the
  end of a training forward (``buffers.py``) stands aside for the block and is done here
  instead.
- **The final model is the last joiner's.** When every rank has left, parameters (and
  buffers, where DDP syncs them) are broadcast from the highest of the last ranks to leave,
  as torch's ``_sync_final_model`` does: a model updated by hand on the running ranks only,
  or a schedule of ``no_sync`` steps, ends the same on every rank.
- ``divide_by_initial_world_size=False``: DDP always averages over the world, so the running
  ranks' output gradients are scaled by ``world_size / running`` in the backward announcement.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite._private.torch_internals import ddp_ignored_names, ddp_owes_buffer_sync, ddp_syncs_gradients
from scopedlite._strategies.ddp.buffers import broadcast_coalesced, synced_buffers
from scopedlite._strategies.join.hook import JoinHook

__all__ = ["DDPJoinHook", "refuse_what_join_cannot_replay"]


class DDPJoinHook(JoinHook):
    """Hooks and replays of DDP models for :class:`~scopedlite._strategies.join.session.JoinSession`."""

    # forward_communicates stays False: but for DDP's buffer broadcast, whose forwards await their round

    def __init__(
        self,
        strategy: Any,
        models: tuple[DistributedDataParallel, ...],
        divide_by_initial_world_size: bool,
        world_size: int,
    ) -> None:
        super().__init__(strategy, models, divide_by_initial_world_size, world_size)
        self._buffers = [strategy.syncs_buffers(m) for m in models]  # the user's DDP setting
        self._synced = [synced_buffers(m) for m in models]  # the buffers DDP would broadcast
        self._trained = [[p for p in m.parameters() if p.requires_grad] for m in models]

    def module(self, index: int) -> torch.nn.Module:
        return self.models[index].module  # type: ignore[no-any-return]

    def zero_grad_owners(self) -> list[tuple[int, torch.nn.Module]]:
        return [owner for i, m in enumerate(self.models) for owner in ((i, m), (i, m.module))]

    def sync_flag(self, index: int) -> bool:
        return ddp_syncs_gradients(self.models[index])

    def backward_syncs(self, index: int, forward_synced: bool) -> bool:
        # DDP's forward decides (it prepares the reducer there): a backward inside no_sync()
        # whose forward ran outside it all-reduces all the same
        return forward_synced

    def holds_gradients(self, index: int) -> bool:
        return any(p.grad is not None for p in self._trained[index])

    def buffer_flag(self, index: int) -> bool:
        model = self.models[index]
        return bool(self._buffers[index] and self._synced[index] and ddp_owes_buffer_sync(model))

    def sync_buffers(self, index: int, source: int) -> None:
        broadcast_coalesced(self._synced[index], source, self.strategy.comm_device)

    def forward(self, index: int, args: Any, kwargs: Any, sync: bool) -> Any:
        model = self.models[index]
        with model.no_sync() if not sync else contextlib.nullcontext():
            return model(*args, **kwargs)

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool, keep_own: bool) -> None:
        params = self._trained[index]
        held = [p.grad for p in params] if outputs and sync and not keep_own else None
        if held is not None:
            for p in params:
                p.grad = None  # contribute zero
        super().backward(index, outputs, sync, keep_own)
        if held is not None:
            for p, grad in zip(params, held):
                if p.grad is None:  # not reduced this step (unused everywhere): as it was
                    p.grad = grad

    def output_scale(self, count: int) -> float:
        return 1.0 if self.divide else self.world_size / count

    def finish(self, authoritative: int) -> None:
        for index, model in enumerate(self.models):
            ignored = ddp_ignored_names(model)
            tensors = [p for n, p in model.module.named_parameters() if n not in ignored]
            if self._buffers[index]:
                tensors += self._synced[index]
            broadcast_coalesced(tensors, authoritative, self.strategy.comm_device)


def refuse_what_join_cannot_replay(models: tuple[Any, ...], optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Raise, before the loop starts, for what a serving rank cannot mirror."""
    # Only a program that imported it can hold one; importing it here would cost ~0.3 s.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    for model in models:
        if getattr(model, "static_graph", False):
            raise ValueError(
                "lite.join cannot be used with DDP's static_graph=True: with uneven inputs "
                "torch aborts the process (gloo SIGABRT) when a rank has no batch or unused "
                "parameters are searched. Use lite.DDPStrategy(static_graph=False) for runs "
                "with uneven inputs."
            )
    for optimizer in optimizers:
        if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
            raise ValueError(  # a valid optimizer, one join cannot mirror
                "lite.join cannot be used with torch's ZeroRedundancyOptimizer: its step "
                "broadcasts each rank's shard, a collective a rank that ran out of data cannot "
                "mirror in step (torch's own join hook steps it with stale gradients instead, "
                "ending with identical but wrong parameters). Use a plain optimizer under "
                "strategy='ddp', or shard optimizer state with strategy='fsdp' / 'deepspeed'."
            )
