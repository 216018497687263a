"""Distributed data parallel: one replica per process, gradients averaged in backward."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite import _distributed
from scopedlite._strategies._process_group import ProcessGroupCollectives
from scopedlite._strategies._base import Rendezvous, Strategy
from scopedlite._strategies._scaler import GradientScaling

if TYPE_CHECKING:
    from scopedlite._run import Run

__all__ = ["DDPStrategy"]

_DDP_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "device_ids",
    "output_device",
    "process_group",
}
_START_METHODS = ("script", "fork")


class DDPStrategy(ProcessGroupCollectives, Strategy):
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
        if start_method is not None and start_method not in _START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not valid; choose one of {_START_METHODS} "
                "or None."
            )
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is not valid; choose "
                "'gloo', 'nccl' or None."
            )
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        self.ddp_options = dict(ddp_options)

    @property
    def launcher(self) -> str | None:  # type: ignore[override]
        return self.start_method

    def fresh(self) -> DDPStrategy:
        copy = super().fresh()
        assert isinstance(copy, DDPStrategy)
        copy.ddp_options = dict(self.ddp_options)
        return copy

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if self.process_group_backend == "nccl" and accelerator != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs accelerator='cuda', not {accelerator!r}; "
                "use 'gloo' (or None) on CPU."
            )

    def backend(self, accelerator: str) -> str:
        return self.process_group_backend or super().backend(accelerator)

    def describe(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.ddp_options.items())
        return f"DDPStrategy({options})"

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, run: Run, rendezvous: Rendezvous | None) -> None:
        assert rendezvous is not None, "DDP needs a rendezvous"
        self.run = run
        self._backend = self.backend(run.accelerator)
        self._comm_device = _distributed.comm_device(self._backend, run.device)
        self.scaling = GradientScaling.for_run(run)
        # In setup order (the same on every rank): join's hooks must run in one order.
        self._modules: list[weakref.ref[DistributedDataParallel]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        world = rendezvous.world
        if run.accelerator == "cuda":
            torch.cuda.set_device(run.device)
        _distributed.init_process_group(
            self._backend, world, timeout=run.timeout, store=rendezvous.store, device=run.device
        )

    def stop(self) -> None:
        _distributed.destroy_process_group()

    # -- modules and optimizers ---------------------------------------------------------
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(module, DistributedDataParallel):
            raise TypeError(
                "lite.setup got a module that is already DistributedDataParallel; pass the "
                "plain module (`lite.setup(model)`) and scopedlite wraps it."
            )
        module = self.run.precision.convert_module(module.to(self.run.device))
        device_ids = [self.run.device.index] if self.run.device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_options)
        self._modules.append(weakref.ref(ddp))
        return ddp

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self._optimizers.append(weakref.ref(optimizer))
        return self.scaling.wrap_optimizer(optimizer)

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.scaling.scale(loss).backward(*args, **kwargs)

    def clip_gradients(self, module, optimizer, max_norm, clip_val):  # type: ignore[no-untyped-def]
        # Gradients are already averaged over ranks after backward: local clipping is global.
        self.scaling.unscale(optimizer)
        return super().clip_gradients(module, optimizer, max_norm, clip_val)

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"lite.no_backward_sync needs the module returned by lite.setup, got a plain "
                f"{type(module).__name__}. Use `model = lite.setup(model)` first."
            )
        return module.no_sync() if enabled else contextlib.nullcontext()

    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        from scopedlite._join_session import ProcessGroupJoin

        modules = tuple(m for m in (ref() for ref in self._modules) if m is not None)
        optimizers = tuple(o for o in (ref() for ref in self._optimizers) if o is not None)
        return ProcessGroupJoin(self, joinables or modules, optimizers, divide_by_initial_world_size)

