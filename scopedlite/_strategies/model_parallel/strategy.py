"""2D parallelism: the user's tensor-parallel plan times FSDP2, over a two-dimensional mesh.

``launch`` arranges the processes in a ``DeviceMesh`` of shape ``(data_parallel,
tensor_parallel)`` with those dimension names: rank ``r`` is replica ``r // tensor_parallel``
and tensor-parallel rank ``r % tensor_parallel`` in it. At ``lite.setup`` the user's
``parallelize(model, mesh)`` applies their plan (``parallelize_module`` over
``mesh["tensor_parallel"]``, ``fully_shard`` over ``mesh["data_parallel"]``, ...).

Everything after the plan is FSDP's and is inherited from :class:`FSDPStrategy`: the meta-device
``sharded_init`` replayed into the shards, the optimizer re-pointed at the new parameters,
the checkpoints (a ``torch.distributed.checkpoint`` folder or one full file), so a checkpoint
written here is read wherever an FSDP one is, and on any other mesh shape. What differs: the
loaders shard over the data-parallel dimension only (the tensor-parallel ranks of one replica
read the same batches), the gradient norm is combined over the meshes the parameters live on,
and ``lite.join`` counts replicas, not processes: the tensor-parallel ranks of a replica run out
of data together, and a replica that has run out replays the others' steps with all its ranks
at once (its tensor-parallel collectives among themselves, FSDP's over the data-parallel
dimension with the replicas still running). For the same reason ``lite.all_reduce``,
``lite.all_gather`` and ``lite.gather_for_metrics`` count each replica once, so an unchanged
evaluation loop gives ddp's numbers (``_comm/replicas.py``); ``lite.broadcast`` and
``lite.barrier`` span every rank.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterator

import torch

from scopedlite._comm.replicas import one_per_replica, reduce_rows
from scopedlite._comm.wire import wire_dtype
from scopedlite._strategies.base import ReduceOp, Rendezvous
from scopedlite._strategies.fsdp.hybrid import square_divisor
from scopedlite._strategies.fsdp.strategy import FSDPStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from scopedlite._core.run import Placement

__all__ = ["DATA_PARALLEL", "TENSOR_PARALLEL", "ModelParallelStrategy", "mesh_shape"]

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"

Parallelize = Callable[[torch.nn.Module, "DeviceMesh"], torch.nn.Module]


def _size(argument: str, value: object) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value  # type: ignore[return-value]
    raise ValueError(f"{argument}={value!r} is not valid: pass a positive number of processes or 'auto'.")


def mesh_shape(data_parallel: int | str, tensor_parallel: int | str, world_size: int, per_node: int) -> tuple[int, int]:
    """The mesh ``(data_parallel, tensor_parallel)`` of a world of ``world_size`` processes,
    ``per_node`` on each node, with "auto" resolved.

    Both "auto": as Lightning Fabric, tensor parallel over the processes of a node and data
    parallel across nodes. One "auto": the rest of the world. Sizes whose product is not the
    world size are refused, naming both.
    """
    dp, tp = data_parallel, tensor_parallel
    if dp == "auto" and tp == "auto":
        tp = per_node
    if dp == "auto":
        dp = world_size // tp if world_size % tp == 0 else 0  # type: ignore[operator]
    elif tp == "auto":
        tp = world_size // dp if world_size % dp == 0 else 0  # type: ignore[operator]
    if int(dp) * int(tp) != world_size:
        suggestion = square_divisor(world_size)
        both_auto = (data_parallel, tensor_parallel) == ("auto", "auto")
        raise ValueError(
            f"ModelParallelStrategy(data_parallel={data_parallel!r}, tensor_parallel={tensor_parallel!r}) "
            f"does not fit a run of {world_size} processes"
            + (f" with {per_node} on a node" if both_auto else "")
            + f": the two sizes must multiply to {world_size}. Choose sizes whose product is the "
            f"world size, e.g. ModelParallelStrategy(parallelize, data_parallel={suggestion}, "
            f"tensor_parallel={world_size // suggestion}), or change devices=."
        )
    return int(dp), int(tp)


class ModelParallelStrategy(FSDPStrategy):
    """Tensor parallel × FSDP2 with your own plan, over a ``(data_parallel, tensor_parallel)`` mesh.

    Args:
        parallelize: ``parallelize(model, mesh) -> model``, your plan: typically
            ``parallelize_module(model, mesh["tensor_parallel"], {...})`` then
            ``fully_shard(model, mesh=mesh["data_parallel"])``. Called by ``lite.setup`` on
            every rank, with the model plain or on the meta device (after ``sharded_init``).
            None (the name ``"model_parallel"``) starts the run, but ``lite.setup`` refuses.
        data_parallel: The number of replicas, each reading its own share of the data, or
            "auto".
        tensor_parallel: The number of processes one replica is split over, or "auto". Both
            "auto": tensor parallel within a node, data parallel across nodes (as Fabric);
            one "auto": the rest of the world. The product must be the world size.
        state_dict_type: What ``lite.save`` writes: ``"sharded"`` (a folder through
            ``torch.distributed.checkpoint``) or ``"full"`` (one file, gathered to rank 0).
        start_method: As for :class:`DDPStrategy`: ``"script"``, ``"fork"`` or None.
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks NCCL on CUDA, else gloo.
    """

    name: ClassVar[str] = "model_parallel"

    def __init__(
        self,
        parallelize: Parallelize | None = None,
        data_parallel: int | str = "auto",
        tensor_parallel: int | str = "auto",
        state_dict_type: str = "sharded",
        start_method: str | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        if parallelize is not None and not callable(parallelize):
            raise TypeError(
                f"parallelize must be a function parallelize(model, mesh) -> model, got "
                f"{type(parallelize).__name__} ({parallelize!r})."
            )
        self.parallelize = parallelize
        self.data_parallel = _size("data_parallel", data_parallel)
        self.tensor_parallel = _size("tensor_parallel", tensor_parallel)
        super().__init__(
            state_dict_type=state_dict_type, start_method=start_method, process_group_backend=process_group_backend
        )
        self._mesh: DeviceMesh | None = None

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        super().check(accelerator, world_size, precision)
        if (self.data_parallel, self.tensor_parallel) != ("auto", "auto"):  # else: needs the node count
            mesh_shape(self.data_parallel, self.tensor_parallel, world_size, per_node=world_size)

    def describe(self) -> str:
        return (
            f"ModelParallelStrategy(data_parallel={self.data_parallel!r}, "
            f"tensor_parallel={self.tensor_parallel!r}, state_dict_type={self.state_dict_type!r})"
        )

    # -- the mesh ---------------------------------------------------------------------------
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        shape = mesh_shape(self.data_parallel, self.tensor_parallel, placement.world_size, placement.local_world_size)
        super().start(placement, rendezvous)
        self._mesh = init_device_mesh(placement.device.type, shape, mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))

    @property
    def mesh(self) -> DeviceMesh:
        """The run's ``DeviceMesh``, dimensions ``"data_parallel"`` and ``"tensor_parallel"``."""
        if self._mesh is None:
            raise RuntimeError(
                "The device mesh exists once the run has started: use it inside `with lite.launch(...)`."
            )
        return self._mesh

    @property
    def data_parallel_rank(self) -> int:
        return int(self.mesh[DATA_PARALLEL].get_local_rank())

    @property
    def data_parallel_size(self) -> int:
        return int(self.mesh[DATA_PARALLEL].size())

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.mesh[TENSOR_PARALLEL].size())

    @property
    def data_parallel_group(self) -> Any:
        """The process group of this process's data-parallel dimension: the ranks holding the
        same tensor-parallel slice in every replica."""
        return self.mesh[DATA_PARALLEL].get_group()

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """The global ranks forming this process's replica (its tensor-parallel group)."""
        return tuple(int(r) for r in self.mesh[TENSOR_PARALLEL].mesh.tolist())

    def join_replicas(self) -> tuple[int, ...]:
        """``lite.join``'s unit: the replica (the mesh's row) of each global rank."""
        replicas = [0] * self.placement.world_size
        for replica, ranks in enumerate(self.mesh.mesh.tolist()):
            for rank in ranks:
                replicas[rank] = replica
        return tuple(replicas)

    # -- collectives: a replica counted once ---------------------------------------------------
    def all_reduce_replicas(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Every rank's value gathered, one per replica kept (its ranks must agree to the
        bit), reduced here: the same result on every rank. One replica per rank: the
        all-reduce."""
        if self.tensor_parallel_size == 1:
            return self.all_reduce(tensor, op)
        rows = self.all_gather_replicas(tensor.to(wire_dtype(tensor.dtype, op)))
        return reduce_rows(rows, op, tensor.dtype)

    def all_gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel_size == 1:
            return self.all_gather(tensor)
        rows = self.all_gather(tensor)
        return one_per_replica(rows, range(self.placement.world_size), self.join_replicas())

    # -- the plan ---------------------------------------------------------------------------
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.tensor import DTensor

        if self.parallelize is None:
            raise RuntimeError(
                "strategy='model_parallel' was given by name, without your plan, so lite.setup "
                "cannot parallelize the model. Pass the strategy with it: "
                "`lite.launch(strategy=lite.ModelParallelStrategy(parallelize), ...)`, where "
                "parallelize(model, mesh) applies your plan and returns the model."
            )
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise TypeError(
                "lite.setup got a model whose parameters are DTensors already (a plan was "
                "applied); pass the plain model (`lite.setup(model)`): lite.setup calls "
                "parallelize(model, mesh) itself."
            )
        return super().setup_module(module)

    def _shard(self, module: torch.nn.Module) -> torch.nn.Module:
        """The user's plan, in place of FSDP's own sharding (see ``FSDPStrategy.setup_module``)."""
        assert self.parallelize is not None
        names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
        result = self.parallelize(module, self.mesh)
        if not isinstance(result, torch.nn.Module):
            raise TypeError(
                f"parallelize(model, mesh) must return the model, got {type(result).__name__}. "
                "End your plan with `return model`."
            )
        changed = sorted(set(names) ^ {name for name, _ in result.named_parameters(remove_duplicate=False)})
        if changed:
            raise ValueError(
                f"parallelize(model, mesh) returned a model whose parameters are named "
                f"differently ({changed[:3]}...); checkpoints and the optimizer find parameters "
                "by name. Apply the plan in place (parallelize_module, fully_shard) and return "
                "the model itself."
            )
        self._refuse_unsynced_replicas(result)
        return result

    def _refuse_unsynced_replicas(self, module: torch.nn.Module) -> None:
        """With several replicas, a parameter the plan left outside the data-parallel
        dimension would get each replica's own gradient: the replicas would drift apart."""
        from torch.distributed.tensor import DTensor

        if self.data_parallel_size == 1:
            return
        for name, param in module.named_parameters():
            if not (isinstance(param, DTensor) and DATA_PARALLEL in (param.device_mesh.mesh_dim_names or ())):
                raise ValueError(
                    f"parallelize(model, mesh) left parameter {name!r} outside the data-parallel "
                    f"dimension: with data_parallel={self.data_parallel_size}, each replica "
                    "would train its own copy of it on its own data and the replicas would "
                    "drift apart. Shard the model over that dimension at the end of your plan: "
                    "`fully_shard(model, mesh=mesh['data_parallel'])`."
                )

    # -- per step ---------------------------------------------------------------------------
    def clip_gradients(self, module, optimizer, max_norm, clip_val, norm_type=2.0):  # type: ignore[no-untyped-def]
        """As under FSDP, mesh by mesh: the plan puts tensor-parallel parameters on the 2D
        mesh and the others on the data-parallel one, and torch's norm and scaling cannot mix
        DTensors of different meshes. The p-norm is taken per mesh and combined."""
        from torch.distributed.tensor import DTensor

        if max_norm is None:  # clamping each value mixes nothing
            return super().clip_gradients(module, optimizer, max_norm, clip_val, norm_type)
        groups: dict[Any, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
                    groups.setdefault(key, []).append(p)
        if norm_type == math.inf:  # the largest local value, then the largest over all ranks
            total = self._max_abs_gradient([p.grad for params in groups.values() for p in params], DTensor)
        else:
            norms = [torch.nn.utils.get_total_norm([p.grad for p in params], norm_type) for params in groups.values()]
            norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
            total = (
                torch.linalg.vector_norm(torch.stack(norms), norm_type)
                if norms
                else torch.zeros((), device=self.placement.device)
            )
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        """Skip the data-parallel gradient reduction of every FSDP unit in ``module``. A plan
        without FSDP (one replica) has no such reduction: nothing to skip. Tensor-parallel
        collectives are part of the computation and always run."""
        from torch.distributed.fsdp import FSDPModule

        if not self.set_up.has_model(module):
            raise TypeError(
                f"lite.no_backward_sync needs the module returned by lite.setup, got a "
                f"{type(module).__name__} that was not set up in this run. Use "
                "`model = lite.setup(model)` first."
            )
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        return _without_gradient_sync(units) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _without_gradient_sync(units: list[Any]) -> Iterator[None]:
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
