"""Every use of torch's private API, in one place, each with the reason it is unavoidable.

If a torch release changes one of these, this is the only file to fix. Checked against
torch 2.13.0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import distributed_c10d

__all__ = [
    "cpu_twin",
    "ddp_reducer_is_reducing",
    "default_store",
    "fsdp_cast_forward_inputs",
    "fsdp_post_forward",
    "fsdp_pre_forward",
    "prepare_ddp_backward",
    "set_group_timeout",
]


def cpu_twin(module: torch.nn.Module, cls: type[torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of ``module`` with full-size CPU tensors of its own and no children.

    Why private: FSDP's ``sharded_init`` must run one module's ``reset_parameters()`` on
    full-size tensors without building the whole model again. Only a module of the user's
    class, created without ``__init__`` (``object.__new__``: a sharded module's class would
    build FSDP state) and given its own ``_parameters``/``_buffers`` dicts, does that; no
    public constructor copies a module without its children.
    """
    twin = object.__new__(cls)  # the user's class: a sharded module's class builds FSDP state
    twin.__dict__.update(module.__dict__)
    twin._parameters = {
        n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for n, p in module._parameters.items()
        if p is not None
    }
    twin._buffers = {
        n: torch.zeros(b.shape, dtype=b.dtype) for n, b in module._buffers.items() if b is not None
    }
    twin._modules = {}
    return twin


def set_group_timeout(timeout: Any) -> None:
    """Change how long the default process group's collectives wait, after it was created.

    Why private: a run we start creates its group under a generous start-up limit (a rank may
    still be importing torch while the others connect) and then bounds collectives by
    ``launch(timeout=)``. ``init_process_group`` takes one timeout for both; the public API
    has no way to change it afterwards, and ``_set_pg_timeout`` (gloo and NCCL) is torch's
    own. Checked against torch 2.3-2.13.
    """
    distributed_c10d._set_pg_timeout(timeout)


def default_store() -> Any:
    """The key-value store of the default process group.

    Why private: a run we start holds its store, but one that joins torchrun's world or a
    group someone else created (Ray, a framework) does not; ``_get_default_store`` is the only
    way to reach the store every rank of the group already shares. Checked against torch 2.13.
    """
    return distributed_c10d._get_default_store()


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


def fsdp_cast_forward_inputs(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a call of ``module``'s own method, cast as FSDP2 casts forward's.

    Why private (with :func:`fsdp_pre_forward` and :func:`fsdp_post_forward`): FSDP2's public
    ``register_fsdp_forward_method`` gathers parameters when a method is entered. The user's
    methods gather only when they first need the parameters (fsdp/methods.py), so that a
    method that reads only their metadata (``numel``, ``shape``) works on any subset of ranks;
    that takes the three steps it runs around a method - input cast, ``_pre_forward``,
    ``_post_forward`` - separately, through ``_get_fsdp_state()``, as it does. Checked against
    torch 2.13 (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``).
    """
    return module._get_fsdp_state()._cast_forward_inputs(args, kwargs)  # type: ignore[operator]


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
