"""Fully sharded data parallel on torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process holds a 1/N slice of every parameter, gradient and optimizer state; parameters
are all-gathered for forward and backward and gradients reduce-scattered. The user's loop
does not change from DDP: ``lite.setup(model, AdamW(model.parameters()))`` works even though
``fully_shard`` replaces every parameter by a sharded ``DTensor`` (the optimizer is re-pointed
at the new parameters), and ``lite.sharded_init()`` builds the model on the meta device and
later fills each shard with exactly the values an unsharded build with the same seed has.
With ``replicate_degree`` above 1 (HSDP, ``hybrid.py``) the processes are sharded in groups
and the groups replicate each other; nothing else changes.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Iterator

import torch
import torch.distributed as dist

from scopedlite._io.canonical import OptimizerEntry, Tensors
from scopedlite._io.consolidate import optimizer_state_to_indices
from scopedlite._strategies.base import Rendezvous
from scopedlite._strategies.fsdp import checkpoint as _checkpoint
from scopedlite._strategies.fsdp.dtensor_collectives import dtensor_collectives_together
from scopedlite._strategies.fsdp.full_loads import shard_full_model_state, shard_full_optimizer_state
from scopedlite._strategies.fsdp.hybrid import REPLICATE, SHARD, check_replicate_degree, hsdp_shape
from scopedlite._strategies.fsdp.init import InitRecords, checkpoint_activations
from scopedlite._strategies.fsdp.join import FSDPJoinHook
from scopedlite._strategies.fsdp.methods import count_depth, gather_for_user_methods
from scopedlite._strategies.fsdp.shard_files import (
    refuse_other_ranks_optimizer_shards,
    refuse_other_ranks_shards,
    tag_optimizer_shards,
    tag_shards,
)
from scopedlite._strategies.fsdp.whole_numbers import whole_numbers
from scopedlite._strategies.join.members import in_join
from scopedlite._strategies.loading import load_module, load_optimizer, parameter_names
from scopedlite._strategies.lockstep import GatherLedger, Nesting
from scopedlite._strategies.process_group_strategy import ProcessGroupStrategy
from scopedlite._strategies.set_up import foreign_parameter
from scopedlite._strategies.stepped import SteppedOptimizers, compared

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from scopedlite._core.run import Placement

# A callable auto_wrap_policy: True for a submodule that becomes its own FSDP unit.
WrapPolicy = Callable[[torch.nn.Module], bool]

# The end of the advice when a method that gathers is called on some ranks only (lockstep.py).
_WITHOUT_GATHERING = (
    ", or compute what one rank needs without the parameters' values: their numel() and "
    "shape are the full ones and need no gathering"
)

# Every rank's full weights from the set-up model, whose state dict holds DTensor shards.
FULL_WEIGHTS = "{k: v.full_tensor() for k, v in model.state_dict().items()}"

__all__ = ["FULL_WEIGHTS", "FSDPStrategy", "fsdp2_problem", "release"]

_STATE_DICT_TYPES = ("sharded", "full")
# What optimizers stepped differently on the ranks did (stepped.py)
_STEPPED_APART = "each rank stepped its shard of the parameters its own way and the model is no longer one model"

# The oldest torch strategy="fsdp" is tested with. Found by running the tests: torch 2.5 has no
# public FSDP2 (torch.distributed.fsdp.fully_shard & co.); 2.6 has it but lacks
# distribute_tensor(src_data_rank=) and FSDP2's CPU streams; with 2.7.1 and 2.8.0 on gloo,
# sharded training ran but gave values up to 0.59 away from one process's (tests/test_fsdp.py).
FSDP2_TORCH = "2.9"
_FSDP2_NAMES = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
)


def release(version: str) -> tuple[int, int]:
    """``"2.9.0+cu128"`` -> ``(2, 9)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def fsdp2_problem(fsdp_module: Any, version: str) -> str | None:
    """Why strategy="fsdp" cannot run with ``fsdp_module`` (``torch.distributed.fsdp`` of torch
    ``version``), or None."""
    missing = [name for name in _FSDP2_NAMES if not hasattr(fsdp_module, name)]
    if not missing and release(version) >= release(FSDP2_TORCH):
        return None
    lacks = f"it lacks torch.distributed.fsdp.{', '.join(missing)}" if missing else "it is older than that"
    return (
        f"strategy='fsdp' needs torch>={FSDP2_TORCH}, the oldest its sharded training was checked "
        f"with, and this is torch {version}: {lacks}. Upgrade torch (pip install "
        f"'torch>={FSDP2_TORCH}'), or use strategy='ddp' or 'deepspeed'."
    )


def _module_classes(argument: str, value: Any) -> frozenset[type[torch.nn.Module]]:
    """Validate a collection of ``torch.nn.Module`` subclasses (a set, list or tuple)."""
    if isinstance(value, type):
        raise TypeError(
            f"{argument}={value.__name__} is a single class; pass a set of module classes, "
            f"e.g. {argument}={{{value.__name__}}}."
        )
    if not isinstance(value, (set, frozenset, list, tuple)) or not value:
        raise TypeError(
            f"{argument} must be a non-empty set of torch.nn.Module subclasses, got {type(value).__name__} ({value!r})."
        )
    bad = [v for v in value if not (isinstance(v, type) and issubclass(v, torch.nn.Module))]
    if bad:
        raise TypeError(f"{argument} must hold torch.nn.Module subclasses only; {bad!r} are not.")
    return frozenset(value)


class FSDPStrategy(ProcessGroupStrategy):
    """FSDP2: parameters, gradients and optimizer state sharded over the processes.

    Args:
        auto_wrap_policy: Which submodules become their own FSDP unit (all-gathered and freed
            on their own, so peak memory is one unit, not the whole model): a set of module
            classes (e.g. ``{TransformerBlock}``) or a callable ``policy(module) -> bool``.
            None shards the whole model as one unit.
        reshard_after_forward: Free the gathered parameters after forward (and gather again
            in backward): less memory, more communication.
        cpu_offload: Keep the sharded parameters, gradients and optimizer step on the CPU
            (``CPUOffloadPolicy``); only meaningful with an accelerator.
        activation_checkpointing: Module classes whose activations are recomputed in
            backward instead of stored (``torch.utils.checkpoint``).
        state_dict_type: What ``lite.save`` writes: ``"sharded"`` (a folder written by every
            rank through ``torch.distributed.checkpoint``, no gathering) or ``"full"`` (one
            file with the whole model, gathered to rank 0).
        replicate_degree: HSDP: the number of replicas of the model. The processes are split
            into that many groups of consecutive ranks; each group holds one copy of the
            model sharded over its processes, and the groups all-reduce their gradients
            (``fully_shard`` over a ``(replicate, shard)`` ``DeviceMesh``; torchtitan's
            ``data_parallel_replicate_degree``, Accelerate's ``dp_replicate_size``). Must
            divide the world size. ``1`` (the default) shards over every process; ``"auto"``
            makes one replica per node, so that all-gathers and reduce-scatters stay inside
            a node and only one all-reduce per unit crosses nodes.
        start_method: As for :class:`DDPStrategy`: ``"script"``, ``"fork"`` or None.
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks NCCL on CUDA, else gloo.
    """

    name: ClassVar[str] = "fsdp"
    accelerators: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def __init__(
        self,
        auto_wrap_policy: set[type[torch.nn.Module]] | WrapPolicy | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: set[type[torch.nn.Module]] | None = None,
        state_dict_type: str = "sharded",
        start_method: str | None = None,
        process_group_backend: str | None = None,
        replicate_degree: int | str = 1,
    ) -> None:
        self.wrap_classes: frozenset[type[torch.nn.Module]] = frozenset()
        self.wrap_policy: WrapPolicy | None = None
        if auto_wrap_policy is not None:
            if callable(auto_wrap_policy) and not isinstance(auto_wrap_policy, type):
                self.wrap_policy = auto_wrap_policy
            else:
                self.wrap_classes = _module_classes("auto_wrap_policy", auto_wrap_policy)
        self.checkpoint_classes: frozenset[type[torch.nn.Module]] = frozenset()
        if activation_checkpointing is not None:
            self.checkpoint_classes = _module_classes("activation_checkpointing", activation_checkpointing)
        for argument, value in (("reshard_after_forward", reshard_after_forward), ("cpu_offload", cpu_offload)):
            if not isinstance(value, bool):
                raise TypeError(f"{argument} must be True or False, got {value!r}.")
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not valid; choose one of {_STATE_DICT_TYPES}.")
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self.replicate_degree = check_replicate_degree(replicate_degree)
        super().__init__(process_group_backend=process_group_backend, start_method=start_method)
        self._fsdp_mesh: DeviceMesh | None = None  # HSDP's (replicate, shard) mesh; None: the world's

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        super().check(accelerator, world_size, precision)
        import torch.distributed.fsdp

        problem = fsdp2_problem(torch.distributed.fsdp, torch.__version__)
        if problem:
            raise ImportError(problem)
        if self.replicate_degree != "auto":  # else: needs the node size, known at start
            hsdp_shape(self.replicate_degree, world_size, per_node=world_size)
        if self.cpu_offload and accelerator == "cpu":
            raise ValueError(
                "FSDPStrategy(cpu_offload=True) moves shards from an accelerator to the CPU, "
                "but the run is on accelerator='cpu' already. Use cpu_offload=False on CPU."
            )
        if precision == "16-mixed":
            raise ValueError(
                f"precision='16-mixed' with strategy={self.name!r} is not supported: fp16 loss scaling "
                "over sharded gradients is not implemented. Use precision='bf16-mixed'."
            )

    def describe(self) -> str:
        hybrid = f", replicate_degree={self.replicate_degree!r}" if self.replicate_degree != 1 else ""
        return (
            f"FSDPStrategy(reshard_after_forward={self.reshard_after_forward}, "
            f"cpu_offload={self.cpu_offload}, state_dict_type={self.state_dict_type!r}{hybrid})"
        )

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        shape = hsdp_shape(self.replicate_degree, placement.world_size, placement.local_world_size)
        super().start(placement, rendezvous)
        self._fsdp_mesh = None
        if shape[0] > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self._fsdp_mesh = init_device_mesh(placement.device.type, shape, mesh_dim_names=(REPLICATE, SHARD))
        self._checkpoint_group: Any = None
        self._init_records = InitRecords()
        # Where each rank notes its gathering steps, so that a method gathering on some ranks
        # only is refused instead of hanging (lockstep.py).
        self._ledger = (
            GatherLedger.of_default_group(
                self.name, _WITHOUT_GATHERING, FULL_WEIGHTS, timeout=placement.timeout.total_seconds()
            )
            if placement.world_size > 1
            else None
        )
        self._run_patches = contextlib.ExitStack()  # undone when the run stops
        self._numbers_whole = False
        # The optimizers that stepped since the last lite.backward, compared there (stepped.py)
        self._stepped = SteppedOptimizers() if placement.world_size > 1 else None
        self._windows = 0  # lite.no_backward_sync windows open

    def stop(self) -> None:
        if getattr(self, "_run_patches", None) is not None:
            self._run_patches.close()
        self._fsdp_mesh = None
        self._checkpoint_group = None  # destroyed with the default group
        super().stop()

    # -- building and sharding ------------------------------------------------------------
    def module_init_context(self, empty: bool) -> ContextManager[Any]:
        """Build on the meta device: no memory at all until :meth:`setup_module` shards."""
        return self._init_records.context(self, empty)

    def _mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = self.placement.precision
        if precision.name == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()  # "-true" modes: parameters are already in their dtype

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            raise TypeError(
                "lite.setup got a module that is already sharded (fully_shard was applied); "
                "pass the plain module (`lite.setup(model)`) and scopedlite shards it."
            )
        on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
        replay = self._init_records.plan(module) if on_meta else None
        if not on_meta:
            module = self.placement.precision.convert_module(module.to(self.placement.device))
            self._broadcast_from_rank_zero(module)
        before = dict(module.named_parameters(remove_duplicate=False))
        module = self._shard(module)

        if replay is not None:
            module.to_empty(device=self.placement.device)
            replay.run()
        # The user's other methods gather the parameters as forward does, when they need them
        # (methods.py), on the model and on each submodule that is its own FSDP unit; after the
        # replay, whose twins copy the module's attributes. A user's plan (model_parallel) may
        # leave the root as it is.
        if isinstance(module, FSDPModule):
            gather_for_user_methods(module, self._ledger, self.set_up)
        elif self._ledger is not None:  # its forwards still gather (tensor-parallel collectives)
            count_depth(module, Nesting(self._ledger), self.set_up)
        if not self._numbers_whole and not in_join():
            # a number read from a sharded value is its whole value, and a collective the
            # user's code starts on DTensors is made by every rank, or refused
            self._run_patches.enter_context(whole_numbers(self._ledger))
            self._run_patches.enter_context(dtensor_collectives_together(self._ledger))
            self._numbers_whole = True

        # A state dict saved by one rank is loaded there only (shard_files.py); a plain one
        # gives each rank its shard (full_loads.py).
        for handle in (
            module.register_state_dict_post_hook(tag_shards),
            module.register_load_state_dict_pre_hook(refuse_other_ranks_shards),
            module.register_load_state_dict_pre_hook(shard_full_model_state),
        ):
            self.set_up.at_end(handle.remove)

        # The sharded parameter that replaced each one, for optimizers built on the plain ones.
        after = dict(module.named_parameters(remove_duplicate=False))
        self.set_up.replace((old, after[name]) for name, old in before.items())
        self.set_up.add_model(module)
        return module

    def _shard(self, module: torch.nn.Module) -> torch.nn.Module:
        """Apply FSDP2 to ``module`` (plain or on the meta device) and return it: the one
        step of :meth:`setup_module` that a strategy with the user's own plan replaces."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        if self.checkpoint_classes:
            checkpoint_activations(module, self.checkpoint_classes)
        options: dict[str, Any] = {
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self._mp_policy(),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
            "mesh": self._fsdp_mesh,  # None: FSDP2's own, over the whole world
        }
        for sub in reversed(list(module.modules())):  # children before parents
            if sub is not module and self._wraps(sub):
                fully_shard(sub, **options)
        fully_shard(module, **options)
        return module

    def _wraps(self, module: torch.nn.Module) -> bool:
        if self.wrap_policy is not None:
            return bool(self.wrap_policy(module))
        return isinstance(module, tuple(self.wrap_classes)) if self.wrap_classes else False

    def _broadcast_from_rank_zero(self, module: torch.nn.Module) -> None:
        """Make every rank start from rank 0's values, as DDP does: each rank keeps its own
        slice of its own tensors, so ranks built with different seeds would mix models."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                work = tensor.detach().to(self._comm_device)
                dist.broadcast(work, src=0)
                if work is not tensor:
                    tensor.copy_(work)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` at the sharded parameters that replaced the ones it was built on.

        Parameter groups and hyper-parameters are kept; each parameter is swapped for its
        sharded successor, found by identity in the modules set up so far.
        """
        sharded = self.set_up.parameter_ids()
        swaps: list[tuple[list[Any], int, torch.nn.Parameter]] = []
        for index, group in enumerate(optimizer.param_groups):
            for position, param in enumerate(group["params"]):
                if id(param) in sharded:
                    continue
                successor = self.set_up.successor(param)
                if successor is None:
                    raise foreign_parameter(index, param, "that belongs to no module set up in this run")
                swaps.append((group["params"], position, successor))
        if swaps and optimizer.state:
            raise ValueError(
                "The optimizer already holds state (it has stepped) for the unsharded "
                "parameters; that state cannot be sharded. Call lite.setup before training."
            )
        for params, position, new in swaps:
            params[position] = new
        # A state dict saved by one rank is loaded there only (shard_files.py); a plain one
        # gives each rank its shard (full_loads.py).
        for handle in (
            optimizer.register_state_dict_post_hook(tag_optimizer_shards),
            optimizer.register_load_state_dict_pre_hook(refuse_other_ranks_optimizer_shards),
            optimizer.register_load_state_dict_pre_hook(shard_full_optimizer_state),
        ):
            self.set_up.at_end(handle.remove)
        self.set_up.add_optimizer(optimizer)
        if self._stepped is not None:
            self._stepped.watch(optimizer, self.set_up)
            self._rounds_group()  # made here, where every rank comes (a collective under NCCL)
        return optimizer

    # -- per step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """A backward outside ``lite.join`` that reduces gradients also compares the steps the
        optimizers took since the previous comparison (an LR scheduler stepped on some ranks
        only): raises on every rank where they differ (stepped.py). Inside the block the
        joined ranks replay the others' steps, and the comparison waits for the first
        backward after it; inside ``lite.no_backward_sync`` for the window's last backward."""
        stepped = None if in_join() or self._windows else self._stepped
        with compared(stepped, self._rounds_group() if stepped is not None else None, _STEPPED_APART):
            super().backward(loss, *args, **kwargs)

    def clips_together(self, by_norm: bool) -> bool:
        return by_norm  # the sharded gradients' norm; values clamp locally

    def note_clip(self, how: str) -> None:
        if self._stepped is not None:  # a clamp of values on some ranks only (stepped.py)
            self._stepped.clipped(how)

    def clip_gradients(self, module, optimizer, max_norm, clip_val, norm_type=2.0):  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if max_norm is None:
            if params:  # torch's clip_grad_value_ fails on no gradient at all
                torch.nn.utils.clip_grad_value_(params, clip_val)
            return None
        # Each rank holds a slice of every gradient: the norm of the slices is partial and
        # must be reduced over all ranks before it is used (DTensor reduces a p-norm as a
        # p-norm: the p-th root of the sum of p-th powers).
        if norm_type == math.inf:
            total = self._max_abs_gradient([p.grad for p in params], DTensor)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
            if isinstance(total, DTensor):
                total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def _max_abs_gradient(self, grads: list[torch.Tensor], dtensor: type) -> torch.Tensor:
        """The inf-norm of gradients sharded over the ranks: the largest local absolute value,
        then the largest over all ranks. torch's own inf-norm fails on a rank whose shard of a
        small parameter is empty ("cannot compute the infinity norm on an empty tensor")."""
        local = [g.to_local() if isinstance(g, dtensor) else g for g in grads]
        found = [t.detach().abs().max().float() for t in local if t.numel()]
        device = grads[0].device if grads else self.placement.device
        part = torch.stack(found).max() if found else torch.zeros((), device=device)
        if self.placement.world_size > 1:
            part = self.all_reduce(part, "max")
        return part

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            raise TypeError(
                f"lite.no_backward_sync needs the module returned by lite.setup, got a plain "
                f"{type(module).__name__}. Use `model = lite.setup(model)` first."
            )
        return self._accumulating(module) if enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _accumulating(self, module: Any) -> Iterator[None]:
        """An accumulation window: no gradient reduced, and no steps compared in its backwards
        (the window's last backward, outside it, compares them)."""
        self._windows += 1
        try:
            with _without_gradient_sync(module):
                yield
        finally:
            self._windows -= 1

    def join_models(self) -> list[torch.nn.Module]:
        return self.set_up.models()

    def join_optimizers(self, models: tuple[torch.nn.Module, ...]) -> tuple[torch.optim.Optimizer, ...]:
        return self.optimizers_of(models, self.set_up.optimizers())

    def join_hook(
        self, models: tuple[Any, ...], optimizers: tuple[torch.optim.Optimizer, ...], divide_by_initial_world_size: bool
    ) -> FSDPJoinHook:
        return FSDPJoinHook(self, models, divide_by_initial_world_size, self.data_parallel_size)

    # -- checkpoints ----------------------------------------------------------------------
    def owner_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The set-up module whose parameters ``optimizer`` updates (state dicts need it)."""
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self.set_up.models():
            if wanted <= {id(p) for p in module.parameters()}:
                return module
        raise ValueError(
            f"Under strategy={self.name!r} an optimizer is saved and loaded together with the one model "
            "it updates, but this optimizer's parameters are not all in one model set up with "
            "lite.setup. Use one optimizer per model."
        )

    def module_state(self, module: torch.nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        state = get_optimizer_state_dict(
            self.owner_of(optimizer), optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        # Gathered to rank 0 only: the other ranks get an empty dict, which they never write.
        return optimizer_state_to_indices(state) if state else state

    def load_module_from(self, module: torch.nn.Module, tensors: Tensors, strict: bool) -> None:
        """Each rank reads the slices of the checkpoint's tensors it holds, from any format."""
        from torch.distributed.fsdp import FSDPModule

        for sub in module.modules():  # sharded, so that writing the shards is the whole story
            if isinstance(sub, FSDPModule):
                sub.reshard()
        load_module(module, tensors, strict)

    def load_optimizer_from(
        self, optimizer: torch.optim.Optimizer, entry: OptimizerEntry, modules: Sequence[torch.nn.Module]
    ) -> None:
        load_optimizer(optimizer, entry, parameter_names(optimizer, [self.owner_of(optimizer)]))

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """``lite.save`` under FSDP: a folder of shards, or one full file (``state_dict_type``)."""
        save = _checkpoint.save_sharded if self.state_dict_type == "sharded" else _checkpoint.save_full
        save(self, Path(path), state)

    def start_checkpoint(
        self, path: str | os.PathLike[str], state: dict[str, Any], staging: Any
    ) -> Callable[[threading.Event], None] | None:
        """``lite.save(..., blocking=False)`` under FSDP: the same folder or file, written in
        the background (``fsdp/checkpoint.py``)."""
        start = _checkpoint.start_sharded if self.state_dict_type == "sharded" else _checkpoint.start_full
        return start(self, Path(path), state, staging)

    def checkpoint_group(self) -> Any:
        """The process group of checkpoints written in the background: gloo, of every rank,
        made at the first such save (every rank saves). Their messages must not share the
        default group with the training's: a group's collectives are matched by the order
        in which each rank issues them, and the writing thread issues its own at any time."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group


@contextlib.contextmanager
def _without_gradient_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
