"""The FSDP2 side of ``lite.join``: hooks and replays for the session (see join/session.py).

- Forward: a pre-hook on each root, registered *prepended* and after ``fully_shard`` (FSDP2
  prepends its own all-gather hook; a hook behind it would meet the all-gather on a joined
  rank), announces the forward; a forward hook wraps the outputs so that their backward is
  announced too.
- Backward on a joined rank: ``torch.autograd.backward`` through the outputs the active ranks'
  loss used, with zero gradients, under the same gradient-sync flag (tracked by wrapping the
  public ``set_requires_gradient_sync`` of the root's outermost FSDP units, which
  ``lite.no_backward_sync`` calls: the root itself under ``fsdp``, whatever the user's plan
  sharded under ``model_parallel``).
- ``optimizer.step``/``zero_grad`` (and the model's own ``zero_grad``) have no collectives
  under FSDP2: they are events.
- A serving rank's replayed backward adds zeros to the reduce-scatter; what it accumulated
  itself inside ``no_backward_sync`` before running out goes with the first synchronised one.
- Buffers (BatchNorm statistics) are each rank's own under FSDP2, which never synchronises
  them; a replayed forward leaves a serving rank's as they were.
- ``divide_by_initial_world_size=False``: every FSDP module divides the reduced gradients by
  the number of active replicas (``set_gradient_divide_factor``); gloo has no PREMUL_SUM, so
  the reduction is forced to a plain sum followed by that division. After the block the
  factor is the number of replicas again (the same mean as FSDP2's default, computed as sum
  then divide). A replica is one rank under ``fsdp``; under ``model_parallel`` it is the
  tensor-parallel ranks that read the same batches, and FSDP reduces over the replicas.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._strategies.join.events import wrap_method
from scopedlite._strategies.join.hook import JoinHook

if TYPE_CHECKING:
    from scopedlite._strategies.fsdp.strategy import FSDPStrategy
    from scopedlite._strategies.join.session import JoinSession

__all__ = ["FSDPJoinHook", "outermost_units"]


class FSDPJoinHook(JoinHook):
    """Hooks and replays of FSDP2 roots for :class:`~scopedlite._strategies.join.session.JoinSession`."""

    forward_communicates = True

    def __init__(
        self,
        strategy: FSDPStrategy,
        roots: tuple[torch.nn.Module, ...],
        divide_by_initial_world_size: bool,
        replicas: int,
    ) -> None:
        super().__init__(strategy, roots, divide_by_initial_world_size, strategy.placement.world_size)
        self.replicas = replicas  # FSDP's data-parallel size: the gradients are reduced over them
        self._sync = [True] * len(roots)
        self._units = [outermost_units(root) for root in roots]

    def _fsdp_modules(self) -> list[Any]:
        from torch.distributed.fsdp import FSDPModule

        return [m for root in self.models for m in root.modules() if isinstance(m, FSDPModule)]

    def install(self, session: JoinSession) -> contextlib.ExitStack:
        stack = super().install(session)
        for index, units in enumerate(self._units):
            for unit in units:
                original = unit.set_requires_gradient_sync

                def tracked(
                    requires_gradient_sync: bool, *, recurse: bool = True, index: int = index, original: Any = original
                ) -> None:
                    if not session.serving:
                        self._sync[index] = requires_gradient_sync
                    original(requires_gradient_sync, recurse=recurse)

                wrap_method(stack, unit, "set_requires_gradient_sync", tracked)
        if not self.divide:
            for module in self._fsdp_modules():
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
                module.set_gradient_divide_factor(float(self.replicas))
            stack.callback(self.active_count, self.replicas)
        return stack

    def sync_flag(self, index: int) -> bool:
        return self._sync[index]

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool, keep_own: bool) -> None:
        units = self._units[index] if outputs and not sync else []
        for unit in units:
            unit.set_requires_gradient_sync(False)
        try:
            super().backward(index, outputs, sync, keep_own)
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True)

    def active_count(self, count: int) -> None:
        """``count`` replicas run now: every FSDP module divides by it (``output_scale``
        stays 1)."""
        if self.divide:
            return
        for module in self._fsdp_modules():
            module.set_gradient_divide_factor(float(count))


def outermost_units(root: torch.nn.Module) -> list[Any]:
    """The FSDP units of ``root`` not inside another one: ``[root]`` when ``fully_shard`` was
    applied to it (always under ``fsdp``), else those a user's plan sharded (none: no gradient
    reduction to skip). ``set_requires_gradient_sync`` on them reaches every unit."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(root, FSDPModule):
        return [root]
    return [unit for child in root.children() for unit in outermost_units(child)]
