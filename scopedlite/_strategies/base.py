"""The strategy interface: one small class per way of spreading a model over processes.

A strategy is configured by its constructor (the options users pass, e.g.
``lite.DDPStrategy(find_unused_parameters=True)``) and brought to life by :meth:`start` once
the run's place in the world is known. ``launch`` works on a copy of the object the user
passed, so one configured instance can serve several launches.

Optional abilities are declared protocols (``scopedlite._strategies.abilities``); the front
end checks for the ability, never for a concrete class, so adding a strategy touches no other.
A strategy is started with a :class:`~scopedlite._core.run.Placement` (ranks, device,
precision), never with the whole run.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch

from scopedlite._core.init import on_device, skip_init
from scopedlite._io.canonical import OptimizerEntry, Tensors
from scopedlite._io.pretrained import PretrainedWeights
from scopedlite._strategies.loading import load_module, load_optimizer, parameter_names
from scopedlite._strategies.set_up import SetUpObjects
from scopedlite._strategies.weights import load_weights

if TYPE_CHECKING:
    from scopedlite._cluster.environments import World
    from scopedlite._comm.distributed import Connection
    from scopedlite._core.run import Placement

__all__ = ["REDUCE_OPS", "ReduceOp", "Rendezvous", "Strategy"]

ReduceOp = str
# The reductions lite.all_reduce takes. A join round names one by its index here.
REDUCE_OPS = ("sum", "mean", "max", "min")


class Strategy(ABC):
    """How modules, optimizers, backward and collectives work in one kind of run.

    Class attributes:
        name: The name ``launch(strategy=...)`` accepts.
        multi_process: Whether the strategy spans several processes.
        accelerators: The accelerators it can run on.
        launcher: The launcher it asks for when ``launcher="auto"`` (``None``: the usual
            choice, a re-executed script or a fork in a notebook).
    """

    name: ClassVar[str]
    multi_process: ClassVar[bool] = True
    accelerators: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "mps")
    launcher: ClassVar[str | None] = None

    placement: Placement
    # What this run set up (set_up.py): the one registry of the objects it handled, weakly.
    set_up: SetUpObjects
    # What the run holds of its torch.distributed process group, where it has one
    # (_comm/distributed.py): made in start, given back in stop.
    connection: Connection | None = None

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must be to be communicated (gloo takes CPU tensors only)."""
        return self.placement.device

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this process reads: its global rank, unless the strategy
        splits the world in more dimensions than data (``model_parallel``)."""
        return self.placement.global_rank

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into: the world size, unless the strategy
        splits the world in more dimensions than data (``model_parallel``)."""
        return self.placement.world_size

    def fresh(self) -> Strategy:
        """A copy of this configured strategy for one run (its state starts empty)."""
        return copy.copy(self)

    def check(self, accelerator: str, world_size: int, precision: str) -> None:  # noqa: B027 - a strategy without limits overrides nothing
        """Raise ``ValueError`` if this strategy cannot run this configuration.

        Called by the resolver before anything starts; the default accepts everything that
        the class attributes allow.
        """

    def backend(self, accelerator: str) -> str:
        """The torch.distributed backend for ``accelerator``."""
        return "nccl" if accelerator == "cuda" else "gloo"

    @abstractmethod
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        """Bring the strategy up at ``placement`` (e.g. create the process group); its first
        step is :meth:`place`."""

    def place(self, placement: Placement) -> None:
        """The first step of every :meth:`start`: the run's place, and its empty registry."""
        self.placement = placement
        self.set_up = SetUpObjects()

    def stop(self) -> None:
        """Release what :meth:`start` acquired. Must be safe to call after a failure.

        Overrides call this first: the run's registry ends, undoing what the run changed on the
        user's objects (``set_up.py``)."""
        set_up = vars(self).get("set_up")  # absent where start failed before placing the run
        if set_up is not None:
            set_up.end()

    def block_body_ended(self) -> None:  # noqa: B027 - only strategies whose ranks wait on each other care
        """This rank has run the whole body of its launch block and waits for the others at
        its end (called before that wait): a rank about to gather alone can then be told."""

    def waiting_at_end(self) -> None:  # noqa: B027 - only strategies that can tell care
        """Called, after :meth:`block_body_ended`, while this rank waits at the end of its
        block for the others: where the strategy can tell, raises if one of them went on to
        a step this rank will never take (a training forward it never ran), which would leave
        both waiting until the timeout."""

    def every_rank_calls(self, call: str, why: str, fix: str, alone: str | None = None) -> None:  # noqa: B027 - only strategies that can tell care
        """``call`` (``"lite.save"``), which every rank makes together, is about to run its
        first collective: where the strategy can tell (its gather ledger), a call on some
        ranks only is refused at once, before that collective meets the others' next step
        (``why``: what every rank does in it; ``fix``: the way out; ``alone``: what a call on
        some ranks would do instead of waiting, for the message)."""

    def collective_called(self, call: str) -> None:  # noqa: B027 - only strategies that can tell care
        """``call`` (``"lite.all_reduce"``), a collective the script called outside
        ``lite.join``, is about to run: where the strategy can tell (its gather ledger), it
        raises at once on a rank that would wait in it for ranks that went on past it."""

    # -- modules and optimizers ---------------------------------------------------------
    @abstractmethod
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module: ...

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside whatever wrapper :meth:`setup_module` added."""
        return module

    def compile_target(self, module: torch.nn.Module) -> torch.nn.Module:
        """The part of the set-up ``module`` that a ``torch.compile``d model is compiled again
        on: by default the set-up model itself (torch's advice for DDP and FSDP: compile
        outside the wrapper)."""
        return module

    def module_init_context(self, empty: bool) -> ContextManager[Any]:
        """Where and how modules are built inside ``lite.sharded_init()``."""
        stack = contextlib.ExitStack()
        stack.enter_context(on_device(self.placement.device))
        stack.enter_context(self.placement.precision.init_dtype())
        if empty:
            stack.enter_context(skip_init())
        return stack

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)

    def clips_together(self, by_norm: bool) -> bool:
        """Whether ``lite.clip_gradients`` (by norm where ``by_norm``, else by value) is a
        collective over every rank here, as a norm of sharded gradients is: a call on some
        ranks only would wait in it, so it is checked against the others first. False where
        each rank clips the gradients it holds whole."""
        return False

    def note_clip(self, how: str) -> None:  # noqa: B027 - only strategies that compare steps care
        """``lite.clip_gradients`` (``how``: its arguments, ``"clip_val=0.5"``) is about to
        clip outside ``lite.join``. Where the ranks compare their optimizers' steps at each
        backward (stepped.py), the clip is digested with the next step: one made on some
        ranks only, which runs no collective where each rank clips what it holds, is refused
        at the next backward instead of parting the replicas without a word."""

    def clip_gradients(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float = 2.0,
    ) -> torch.Tensor | None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        with_gradients = [p for p in params if p.grad is not None]
        if with_gradients:  # torch's clip_grad_value_ fails on none ("Expected !nested_tensorlist[0].empty()")
            torch.nn.utils.clip_grad_value_(with_gradients, clip_val)  # type: ignore[arg-type]
        return None

    # -- collectives (only called with world_size > 1) ----------------------------------
    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def broadcast(self, obj: Any, src: int) -> Any: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def all_reduce_replicas(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """``lite.all_reduce``'s reduction: each data-parallel replica counted once. Every
        rank is a replica of its own, so this is :meth:`all_reduce`, unless the strategy
        splits a replica over several processes (``model_parallel``: ``_comm/replicas.py``)."""
        return self.all_reduce(tensor, op)

    def all_gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """``lite.all_gather``'s and ``lite.gather_for_metrics``' gather: one row per
        data-parallel replica (see :meth:`all_reduce_replicas`)."""
        return self.all_gather(tensor)

    # -- checkpoints ---------------------------------------------------------------------
    def module_state(self, module: torch.nn.Module) -> dict[str, Any]:
        return self.unwrap(module).state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_module_from(self, module: torch.nn.Module, tensors: Tensors, strict: bool) -> None:
        """Load a module entry of any checkpoint (``_io.canonical``) into ``module``."""
        load_module(self.unwrap(module), tensors, strict)

    def load_optimizer_from(
        self, optimizer: torch.optim.Optimizer, entry: OptimizerEntry, modules: Sequence[torch.nn.Module]
    ) -> None:
        """Load an optimizer entry of any checkpoint into ``optimizer``; its parameters are
        named after ``modules`` (the models loaded with it)."""
        load_optimizer(optimizer, entry, parameter_names(optimizer, [self.unwrap(m) for m in modules]))

    def load_weights(self, module: torch.nn.Module, weights: PretrainedWeights, strict: bool) -> None:
        """Copy pretrained ``weights`` into the set-up ``module``, each rank reading only the
        part it holds (``weights.py``)."""
        load_weights(self.unwrap(module), weights, strict)

    def describe(self) -> str:
        return f"strategy={self.name!r}"


class Rendezvous:
    """Where the processes of a run meet: an existing store, or an address and port."""

    def __init__(self, world: World, store: Any = None) -> None:
        self.world = world
        self.store = store
