"""Every use of torch's private API, in one place, each with the reason it is unavoidable.

If a torch release changes one of these, this is the only file to fix. Checked against
torch 2.13.0.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "OpFacts",
    "OpInterceptor",
    "compiled_parts",
    "cpu_attention_ops",
    "ddp_comm_hook",
    "ddp_ignored_names",
    "ddp_owes_buffer_sync",
    "ddp_reducer_is_reducing",
    "ddp_syncs_gradients",
    "default_store",
    "forget_dtensor_shardings",
    "functional_collectives",
    "held_by_python_only",
    "fsdp_cast_forward_inputs",
    "fsdp_post_forward",
    "fsdp_pre_forward",
    "fsdp_subclass_namespace",
    "group_sequence_numbers",
    "has_registered",
    "leave_torch_join",
    "live_process_groups",
    "local_box",
    "op_facts",
    "overwrite_buffers",
    "prepare_ddp_backward",
    "recompile",
    "registered_submodule",
    "set_group_timeout",
    "storage_key",
]


def set_group_timeout(timeout: Any) -> None:
    """Change how long the default process group's collectives wait, after it was created.

    Why private: a run we start creates its group under a generous start-up limit (a rank may
    still be importing torch while the others connect) and then bounds collectives by
    ``launch(timeout=)``. ``init_process_group`` takes one timeout for both; the public API
    has no way to change it afterwards, and ``_set_pg_timeout`` (gloo and NCCL) is torch's
    own. Checked against torch 2.9.0 and 2.13.0.
    """
    distributed_c10d._set_pg_timeout(timeout)


def overwrite_buffers(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copy ``values`` into ``buffers`` in place without bumping their version counters.

    ``lite.join`` puts a module's buffers back after a replayed forward (and sets them from
    the running rank that DDP under torch's ``Join`` takes them from) between a forward and
    its backward.

    Why private: BatchNorm's backward saves the running statistics it was given, though in
    training it does not read them; a plain ``copy_`` would make that backward refuse to run.
    DDP's own buffer broadcast hides its copy the same way, with
    ``torch.autograd._unsafe_preserve_version_counter``. Checked against torch 2.13.
    """
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
        for buffer, value in zip(buffers, values):
            buffer.copy_(value)


class OpInterceptor(TorchDispatchMode):
    """A context in which every aten operation goes through :meth:`intercept` first.

    Why private: ``sharded_init`` records how a model is built, operation by operation, on
    the meta device, and refuses what it cannot replay. ``TorchDispatchMode`` is documented
    (the ``__torch_dispatch__`` extension point) but lives in ``torch.utils._python_dispatch``;
    no public module exports it. Checked against torch 2.3-2.13.
    """

    def intercept(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.intercept(func, tuple(args), dict(kwargs or {}))


def held_by_python_only(tensor: torch.Tensor) -> bool:
    """Whether nothing but its Python object holds ``tensor`` (no collective keeps it).

    Why private: gloo's worker thread keeps a collective's tensors a moment past the caller's
    return, and a tensor Python drops before that is freed by that C++ thread, which takes the
    GIL (see ``_comm/payloads.py``). No public API says when a c10d ``Work`` has let go of its
    tensors; ``Tensor._use_count()`` is the reference count of the tensor's ``TensorImpl``,
    1 when only the Python object holds it. Checked against torch 2.13.0.
    """
    use_count = getattr(tensor, "_use_count", None)
    return use_count is None or int(use_count()) <= 1  # without it: let go at once, as before


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, shared by every view of it (meta tensors too).

    Why private: views, ``nn.Parameter`` and ``.data`` make several tensor objects over one
    storage, and a meta tensor has no data pointer to tell storages apart. The address of the
    storage's ``StorageImpl`` (``UntypedStorage._cdata``) is what torch itself uses for this
    (``torch.multiprocessing.reductions.StorageWeakRef``). The caller keeps the storage alive
    while it uses the key, so the address is not reused.
    """
    return int(tensor.untyped_storage()._cdata)


@dataclass(frozen=True)
class OpFacts:
    """What the schema of one aten operation says (see :func:`op_facts`)."""

    random: bool  # draws from a random generator
    factory: bool  # creates a tensor from no tensor (has a ``device`` argument and no tensor input)
    written: tuple[tuple[int, str], ...]  # (position, name) of the arguments it writes in place
    takes_generator: bool


@functools.cache
def op_facts(func: Any) -> OpFacts:
    """Read an aten operation's schema: random or not, factory or not, which arguments it writes.

    Why private: an ``OpOverload``'s schema (``func._schema``) is the only place that says
    which arguments an operation mutates (``Tensor(a!)``) and which are tensors; torch's own
    passes read it the same way. The random tag is public (``torch.Tag.nondeterministic_seeded``).
    Checked against torch 2.13.
    """
    schema = func._schema
    arguments = list(schema.arguments)
    tensor_input = any(
        isinstance(a.type, (torch.TensorType, torch.OptionalType, torch.ListType)) and "Tensor" in str(a.type)
        for a in arguments
    )
    written = tuple((i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)
    names = {a.name for a in arguments}
    return OpFacts(
        random=torch.Tag.nondeterministic_seeded in func.tags,
        factory="device" in names and not tensor_input,
        written=written,
        takes_generator="generator" in names,
    )


def compiled_parts(module: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[Any], Any]] | None:
    """For a module returned by ``torch.compile(model)``: the original module and a function
    that compiles a callable with the same options. None for any other module.

    Why private: ``torch.compile(model)`` returns an ``OptimizedModule`` whose parameters and
    state dict keys carry an ``_orig_mod.`` prefix, and whose options (backend, mode,
    fullgraph, dynamic) live only in its ``dynamo_ctx``; torch keeps no public record of them.
    ``lite.setup`` sets up ``_orig_mod`` and compiles the strategy's wrapper with the same
    ``dynamo_ctx``, exactly as ``torch.compile`` would have. Checked against torch 2.13.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    return module._orig_mod, module.dynamo_ctx


def recompile(module: torch.nn.Module, compiler: Callable[[Any], Any]) -> None:
    """Compile ``module`` in place with ``compiler`` (from :func:`compiled_parts`), as the
    public ``module.compile(**options)`` does: its ``__call__`` runs compiled, the object and
    its state dict keys stay as they are.

    Why private: ``nn.Module.compile`` takes the options as arguments, which an
    ``OptimizedModule`` does not give back; it stores the compiled call in
    ``_compiled_call_impl``, which is set here from the original's ``dynamo_ctx``. Checked
    against torch 2.13.
    """
    module._compiled_call_impl = compiler(module._call_impl)


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)``: where the part of the DTensor ``tensor`` that this rank holds
    lies in the whole tensor.

    Why private: loading a checkpoint into a sharded model reads, for each parameter, only
    the slice this rank holds, and DTensor has no public accessor for where that slice lies;
    ``compute_local_shape_and_global_offset`` is what DTensor's own checkpointing uses.
    Checked against torch 2.13.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offsets), tuple(sizes)


def default_store() -> Any:
    """The key-value store of the default process group.

    Why private: a run we start holds its store, but one that joins torchrun's world or a
    group someone else created (Ray, a framework) does not; ``_get_default_store`` is the only
    way to reach the store every rank of the group already shares. Checked against torch 2.13.
    """
    return distributed_c10d._get_default_store()


def cpu_attention_ops() -> tuple[Any, Any]:
    """The ATen ops ``F.scaled_dot_product_attention`` runs on CPU tensors (forward, backward).

    Why private: ``torch.utils.flop_counter.FlopCounterMode`` takes formulas for ops it does
    not know through its public ``custom_mapping``, keyed by the op; torch 2.13's counter
    knows the CUDA attention kernels but not this CPU one (it counts it as 0 FLOPs), and the
    op has no public name. Checked against torch 2.13.
    """
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


def ddp_reducer_is_reducing(ddp: Any) -> bool:
    """Whether DDP's reducer has started reducing gradients in the backward under way.

    Why private: a result of the user's own method prepares DDP's reducer when its backward
    starts (user_model.py); when the same backward also runs through the output of DDP's
    forward, the reducer was prepared at that forward and gradients may already be on their
    way, and preparing again would reset its accounting mid-backward. The reducer says so only
    through ``_check_reducer_finalized`` (``DistributedDataParallel._check_reducer_finalized``
    wraps it), which raises while a reduction is unfinished. Checked against torch 2.13.
    """
    try:
        ddp.reducer._check_reducer_finalized()
    except RuntimeError:
        return True
    return False


def prepare_ddp_backward(ddp: Any, outputs: list[torch.Tensor]) -> None:
    """Prepare DDP's gradient all-reduce for the backward of ``outputs``, which is starting.

    Why private: DDP prepares its reducer in ``forward`` (``_pre_forward`` / ``_post_forward``),
    and a forward whose output is never back-propagated leaves it expecting a backward: the
    next ``no_sync`` micro-step of that rank then all-reduces, one collective ahead of the
    other ranks. The user's own methods run outside DDP's forward, and this does, when their
    result is back-propagated (on every rank, as any DDP backward), the same local steps
    ``_pre_forward`` and ``_post_forward`` do for a forward with gradients and sync on: lazy
    init, runtime logging, ``prepare_for_forward``, the one-time bucket rebuild (a collective,
    met by every rank in this backward), ``require_forward_param_sync`` and
    ``prepare_for_backward`` (searching ``outputs`` for unused parameters when DDP does). The
    buffer broadcast of ``_pre_forward`` is left to the next forward. None of it is public.
    Checked against torch 2.13 (``DistributedDataParallel._pre_forward`` / ``_post_forward``).
    """
    if ddp._use_python_reducer or ddp._delay_all_reduce_all_params:
        return  # DDP's forward does not touch the reducer in these modes either
    if not ddp._lazy_init_ran:
        ddp._lazy_init()
    ddp.logger.set_runtime_stats_and_log()
    ddp.reducer.prepare_for_forward()
    if ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
    ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward(outputs if ddp.find_unused_parameters and not ddp.static_graph else [])


def fsdp_cast_forward_inputs(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a call of ``module``'s own method, cast as FSDP2 casts forward's.

    Why private (with :func:`fsdp_pre_forward` and :func:`fsdp_post_forward`): FSDP2's public
    ``register_fsdp_forward_method`` gathers parameters when a method is entered. The user's
    methods gather only when they first need the parameters (fsdp/methods.py), so that a
    method that reads only their metadata (``numel``, ``shape``) works on any subset of ranks;
    that takes the three steps it runs around a method - input cast, ``_pre_forward``,
    ``_post_forward`` - separately, through ``_get_fsdp_state()``, as it does. Checked against
    torch 2.13 (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``) and 2.9.
    """
    state = module._get_fsdp_state()  # type: ignore[operator]
    cast = getattr(state, "_cast_forward_inputs", None)
    if cast is not None:
        return cast(args, kwargs)
    # torch before 2.13 (checked on 2.9): the same cast, inline in FSDPState._pre_forward.
    policy = state._mp_policy
    if not (policy.cast_forward_inputs and policy.param_dtype):
        return args, kwargs
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    cast_fn = functools.partial(_cast_fp_tensor, policy.param_dtype)
    return _apply_to_tensors(cast_fn, args), _apply_to_tensors(cast_fn, kwargs)


def fsdp_pre_forward(module: torch.nn.Module) -> None:
    """FSDP2's pre-forward of ``module`` (gather its parameter group), for one of its methods.

    Why private: see :func:`fsdp_cast_forward_inputs`. Checked against torch 2.13.
    """
    module._get_fsdp_state()._pre_forward(module, (), {})  # type: ignore[operator]


def fsdp_post_forward(module: torch.nn.Module, output: Any) -> Any:
    """FSDP2's post-forward of ``module`` (reshard; backward hooks on ``output``).

    Why private: see :func:`fsdp_cast_forward_inputs`. Checked against torch 2.13.
    """
    return module._get_fsdp_state()._post_forward(module, (), output)  # type: ignore[operator]


def fsdp_subclass_namespace(fsdp_class: type, mixins: int) -> dict[str, Any]:
    """What a subclass of FSDP2's ``FSDP<Orig>`` class with ``mixins`` classes mixed in before
    it must say so that ``FSDPModule.__new__`` (which builds the *original* class, e.g. when
    a container is indexed into: ``Sequential[1:]``) still finds that class in its MRO.

    Why private: ``__new__`` reads the original class at ``_orig_cls_mro_index`` in the MRO,
    which every class mixed in before FSDP's shifts (unshifted it finds FSDP's class, whose
    ``__new__`` builds the original: its ``__init__`` runs twice); there is no public way to
    say so. Checked
    against torch 2.13 and 2.9 (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``).
    """
    index = getattr(fsdp_class, "_orig_cls_mro_index", None)
    return {} if index is None else {"_orig_cls_mro_index": index + mixins}


def forget_dtensor_shardings() -> None:
    """Empty DTensor's sharding-propagation caches (the Python one and the C++ fast path's).

    Their entries hold output specs, and a spec holds its DeviceMesh, which names its process
    groups; the keys compare meshes by shape and dimension names only. A mesh of a run whose
    groups are gone (an earlier launch block of this process, or of the parent a worker was
    forked from, where rank 0's group names are not this rank's) then equals this run's, and
    a DTensor op hands out the stale mesh: its next collective fails ("Could not resolve the
    process group") or reaches a live group of the same name.

    Why private: torch has no public way to clear them
    (``torch.distributed.tensor.debug._clear_sharding_prop_cache`` makes these two calls, on
    torch 2.13 only); each is called only where it exists. Checked against torch 2.9.0 (the
    Python cache alone) and 2.13.0.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # never imported: nothing cached
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    cache = getattr(propagator, "propagate_op_sharding", None)
    if hasattr(cache, "cache_clear"):
        cache.cache_clear()
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast_path is not None:
        fast_path()


def live_process_groups() -> list[Any]:
    """Every process group this process holds: the default one and every subgroup (DDP's,
    a DeviceMesh's, DeepSpeed's, ours).

    Why private: torch lists them only in ``distributed_c10d._world.pg_map``; the public API
    names the default group alone. Checked against torch 2.9.0 and 2.13.0.
    """
    return list(distributed_c10d._world.pg_map)


def group_sequence_numbers() -> tuple[int, ...] | None:
    """How many collectives each process group of this process has started, None where
    torch cannot say.

    Why private: the hang watchdog (``scopedlite/_launch/stall.py``) must tell a rank that
    stands in one collective from one that runs a loop of short ones; the groups count their
    collectives (gloo and NCCL, for the flight recorder and desync debugging) and expose the
    count only as ``_get_sequence_number_for_group``. Read from another thread while the main
    thread waits in a collective: the count has a lock of its own. Checked against torch 2.13.
    """
    try:
        return tuple(int(group._get_sequence_number_for_group()) for group in distributed_c10d._world.pg_map)
    except Exception:  # noqa: BLE001 - a group being destroyed, a backend without a count
        return None


# -- nn.Module's registries, read past a wrapper's attribute lookup ---------------------------

_REGISTRIES = ("_parameters", "_buffers", "_modules")


def registered_submodule(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The submodule ``module`` registered as ``name`` (DDP's and DeepSpeed's ``module``),
    read from its ``__dict__``; None where it has none, or has no registry yet (an object
    being unpickled or copied, before ``nn.Module.__init__``'s state is in place).

    Why private: the set-up model answers attribute lookups for the user's module inside it
    (``_strategies/user_model.py``, ``deepspeed/engines.py``), and to do so it must reach that
    module without an attribute lookup of its own: ``getattr``, ``get_submodule`` and
    ``named_children`` all go through the overridden ``__getattr__``/``__getattribute__`` and
    would come back there forever. ``nn.Module`` keeps its submodules in the ``_modules`` dict
    of its ``__dict__``, which no public API hands out. Checked against torch 2.13.
    """
    modules = module.__dict__.get("_modules")
    return modules.get(name) if modules is not None else None


def has_registered(module: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is one of ``module``'s own parameters, buffers or submodules (also one
    registered as None), read from its ``__dict__``.

    Why private: see :func:`registered_submodule`: the set-up model decides whose a name is
    before any attribute lookup. The public ``named_parameters(recurse=False)``,
    ``named_buffers`` and ``named_children`` read the registries through attribute lookup and
    skip names registered as None; the registries are the ``_parameters``, ``_buffers`` and
    ``_modules`` dicts of ``nn.Module``'s ``__dict__``. Checked against torch 2.13.
    """
    own = module.__dict__
    return any(name in own.get(registry, {}) for registry in _REGISTRIES)


# -- DistributedDataParallel's bookkeeping attributes -----------------------------------------


def ddp_syncs_gradients(ddp: Any) -> bool:
    """Whether a backward through ``ddp``'s next forward all-reduces gradients: False inside
    ``ddp.no_sync()``.

    Why private: ``no_sync()`` is public, but the flag it lowers, ``require_backward_grad_sync``
    (read by DDP's forward to decide whether to prepare the reducer), is a plain undocumented
    attribute; nothing public says whether a ``no_sync`` block is open. Checked against
    torch 2.13 (``DistributedDataParallel.no_sync`` / ``_pre_forward``).
    """
    return bool(ddp.require_backward_grad_sync)


def ddp_owes_buffer_sync(ddp: Any) -> bool:
    """Whether ``ddp``'s last forward owes a buffer broadcast: it ran with gradients enabled
    outside ``no_sync()``, so DDP would broadcast buffers at the start of the next forward.

    Why private: DDP keeps this in ``require_forward_param_sync``, a plain undocumented
    attribute its ``_post_forward`` sets (and its ``_pre_forward`` reads); there is no public
    accessor. Checked against torch 2.13 (``DistributedDataParallel._post_forward``).
    """
    return bool(ddp.require_forward_param_sync)


def ddp_comm_hook(ddp: Any) -> Any:
    """The communication hook registered on DDP model ``ddp`` (None: none).

    Why private: a hook can be registered on a DDP model only once, and the set-up model has
    ours (``ddp/counted.py``); a hook the user registers then runs inside it, which needs ours
    back. DDP keeps the registered ``(hook, state)`` pairs in ``_comm_hooks`` and has no
    public getter. Checked against torch 2.9.0 and 2.13.0.
    """
    hooks = getattr(ddp, "_comm_hooks", None) or []
    return hooks[0][0] if hooks else None


def leave_torch_join(joinable: Any) -> None:
    """Turn off torch's join mode on ``joinable`` (a DDP model) after its ``Join`` block ended.

    Why private: ``Join`` writes each joinable's ``_join_config`` when a block begins and never
    clears it, so after the block every training forward of a DDP model still all-reduces
    a "not joined yet" flag (``Join.notify_join_context``): one collective more per step for
    the rest of the run, and a backward skipped on one rank then meets that flag's all-reduce
    (gloo aborts on the sizes) instead of the check that names the skip
    (``ddp/counted.py``). The next ``Join`` block writes the config again. Checked against
    torch 2.9.0 and 2.13.0 (``torch/distributed/algorithms/join.py``).
    """
    from torch.distributed.algorithms.join import _JoinConfig

    joinable._join_config = _JoinConfig.construct_disabled_join_config()


def ddp_ignored_names(ddp: Any) -> set[str]:
    """The names of the parameters and buffers ``ddp`` neither synchronises nor broadcasts
    (those named by ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    before it was built), in the user's module's terms.

    Why private: DDP keeps them in ``parameters_to_ignore``, a plain undocumented attribute
    built from the module's ``_ddp_params_and_buffers_to_ignore``; no public API lists them.
    Checked against torch 2.13 (``DistributedDataParallel.__init__``).
    """
    return ddp.parameters_to_ignore  # type: ignore[no-any-return]


def functional_collectives() -> tuple[Any, tuple[str, ...]]:
    """torch's functional collectives module, and the names of its collectives present.

    Why private: a DTensor reaches the other ranks through these functions (its placements'
    reductions, gathers and scatters: ``p.norm()`` of a sharded parameter turned into a
    number), not through a ``torch.distributed`` call, and torch has no public hook that runs
    before a collective. Inside ``lite.join`` such a call from the user's loop would wait for
    the ranks that ran out of data; ``join/guards.py`` refuses it through these names. Checked
    against torch 2.9.0 (``all_gather_tensor``, ``reduce_scatter_tensor``) and 2.13.0 (which
    adds ``all_gather_single`` and ``reduce_scatter_single`` and calls those).
    """
    import torch.distributed._functional_collectives as funcol

    names = (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_tensor",
        "all_gather_single",
        "all_gather_tensor_autograd",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor_autograd",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "all_to_all_single_autograd",
        "broadcast",
        "permute_tensor",
    )
    return funcol, tuple(name for name in names if hasattr(funcol, name))
