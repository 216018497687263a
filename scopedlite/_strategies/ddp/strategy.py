"""Distributed data parallel: one replica per process, gradients averaged in backward."""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite._private.torch_internals import ddp_comm_hook
from scopedlite._strategies.base import Rendezvous
from scopedlite._strategies.ddp.buffers import take_over_buffer_sync
from scopedlite._strategies.ddp.counted import count_of, counted_backwards
from scopedlite._strategies.ddp.join import DDPJoinHook, refuse_what_join_cannot_replay
from scopedlite._strategies.ddp.model import SetUpDDP
from scopedlite._strategies.lockstep import GatherLedger
from scopedlite._strategies.process_group_strategy import ProcessGroupStrategy
from scopedlite._strategies.scaler import GradientScaling, ScaledBackward
from scopedlite._strategies.set_up import foreign_parameter, parameters_outside
from scopedlite._strategies.stepped import SteppedOptimizers
from scopedlite._strategies.user_model import present_as_user_model

if TYPE_CHECKING:
    from scopedlite._core.run import Placement

__all__ = ["DDPStrategy"]

_DDP_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "output_device",
    "process_group",
}


class DDPStrategy(ScaledBackward, ProcessGroupStrategy):
    """``torch.nn.parallel.DistributedDataParallel`` over one process per device.

    Args:
        start_method: How our launcher starts the other local processes when
            ``launch(launcher="auto")``: ``"script"`` re-executes the command line,
            ``"fork"`` forks (notebooks). None picks by where the code runs.
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks NCCL on CUDA, else gloo.
        **ddp_options: Passed on to ``DistributedDataParallel`` (e.g.
            ``find_unused_parameters=True``, ``static_graph=False``, ``bucket_cap_mb=25``).
            Unknown names raise ``TypeError`` at once.
    """

    name: ClassVar[str] = "ddp"
    accelerators: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def __init__(
        self,
        start_method: str | None = None,
        process_group_backend: str | None = None,
        **ddp_options: Any,
    ) -> None:
        unknown = sorted(set(ddp_options) - _DDP_OPTIONS)
        if unknown:
            raise TypeError(
                f"DDPStrategy got unknown option(s) {unknown}; options passed on to "
                f"DistributedDataParallel are: {sorted(_DDP_OPTIONS)}."
            )
        super().__init__(process_group_backend=process_group_backend, start_method=start_method)
        self.ddp_options = dict(ddp_options)

    def fresh(self) -> DDPStrategy:
        copy = super().fresh()
        assert isinstance(copy, DDPStrategy)
        copy.ddp_options = dict(self.ddp_options)
        return copy

    def describe(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.ddp_options.items())
        return f"DDPStrategy({options})"

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        super().start(placement, rendezvous)
        self.scaling = GradientScaling.for_placement(placement)
        self._stepped = SteppedOptimizers()  # the optimizers that stepped since the last backward
        # Each rank notes its training forwards, so that lite.save on some ranks only is
        # refused at once, not left to meet the others' next backward (lockstep.py).
        self._ledger = (
            GatherLedger.of_default_group(self.name, timeout=placement.timeout.total_seconds(), gathers=False)
            if placement.world_size > 1
            else None
        )

    # -- modules and optimizers ---------------------------------------------------------
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(module, DistributedDataParallel):
            raise TypeError(
                "lite.setup got a module that is already DistributedDataParallel; pass the "
                "plain module (`lite.setup(model)`) and scopedlite wraps it."
            )
        module = self.placement.precision.convert_module(module.to(self.placement.device))
        device_ids = [self.placement.device.index] if self.placement.device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_options)
        # Every rank runs the same synchronised backwards, or all refuse at once (counted.py).
        refused = self._ledger.realign if self._ledger is not None else None
        hook = counted_backwards(self._rounds_group(), self._note_forward, refused, self._stepped)
        ddp.register_comm_hook(None, hook)
        # Answers the user's attributes, methods and plain state dict keys (user_model.py).
        present_as_user_model(ddp, SetUpDDP)
        # Rank 0's buffers at the end of each training forward, not at the start of the next:
        # an evaluation on rank 0 alone then needs no other rank (buffers.py). The run's
        # registry keeps, for each model in setup order, whether it syncs them.
        self.set_up.add_model(ddp, take_over_buffer_sync(ddp, self.comm_device))
        return ddp

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        foreign = parameters_outside(optimizer, self.set_up.parameter_ids())
        if foreign:
            self._refuse_training_foreign(optimizer, foreign)
        self.set_up.add_optimizer(optimizer)
        self._stepped.watch(optimizer, self.set_up)  # compared at each backward (stepped.py)
        return self.scaling.wrap_optimizer(optimizer, self.set_up)

    def note_clip(self, how: str) -> None:
        self._stepped.clipped(how)  # compared with the next step's digest (stepped.py)

    def _refuse_training_foreign(self, optimizer: torch.optim.Optimizer, foreign: list[tuple[int, Any]]) -> None:
        """DDP averages the gradients of its module's parameters only: one that no set-up
        model holds would be trained by each rank on its own batches, and the ranks' copies
        would drift apart without a word. Such a parameter is refused at the first step that
        would train it (it has a gradient), on every rank alike; one whose model is set up
        later (``lite.setup(g, opt)``, then ``lite.setup(d)``) is fine. Checked by a step
        pre-hook until every such parameter found its model, and at the run's end."""

        def check(*_: Any) -> None:
            if not foreign:  # each found its model (the hook stays: torch is iterating the hooks)
                return
            held = self.set_up.parameter_ids()
            foreign[:] = [(index, p) for index, p in foreign if id(p) not in held]
            for index, param in foreign:
                if param.grad is not None:
                    raise foreign_parameter(
                        index,
                        param,
                        "that belongs to no model set up in this run",
                        ": DDP averages only its models' gradients, so each rank would train its own copy of it",
                    )

        self.set_up.at_end(optimizer.register_step_pre_hook(check).remove)

    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        # inside the block the ranks run different numbers of their own forwards on purpose
        self._pause_counts(True)
        return super().join(joinables, divide_by_initial_world_size)

    def join_left(self) -> None:
        super().join_left()
        self._pause_counts(False)  # every rank leaves here together: the counts start again

    def _pause_counts(self, paused: bool) -> None:
        for model in self.set_up.models():
            count = count_of(ddp_comm_hook(model))
            if count is not None:
                count.paused, count.forwards = paused, 0

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"lite.no_backward_sync needs the module returned by lite.setup, got a plain "
                f"{type(module).__name__}. Use `model = lite.setup(model)` first."
            )
        return module.no_sync() if enabled else contextlib.nullcontext()

    def syncs_buffers(self, module: DistributedDataParallel) -> bool:
        """Whether the set-up ``module`` broadcasts rank 0's buffers after training forwards
        (DDP's ``broadcast_buffers``, unless the user turned it off)."""
        return bool(self.set_up.record(module, False))

    def join_models(self) -> list[torch.nn.Module]:
        return self.set_up.models()

    def join_optimizers(self, models: tuple[torch.nn.Module, ...]) -> tuple[torch.optim.Optimizer, ...]:
        return self.optimizers_of(models, self.set_up.optimizers())

    def join_hook(
        self, models: tuple[Any, ...], optimizers: tuple[torch.optim.Optimizer, ...], divide_by_initial_world_size: bool
    ) -> DDPJoinHook:
        refuse_what_join_cannot_replay(models, optimizers)
        return DDPJoinHook(self, models, divide_by_initial_world_size, self.placement.world_size)
