"""Every use of DeepSpeed's private API, in one place, each with the reason it is unavoidable.

Checked against deepspeed 0.19.8. DeepSpeed is imported by the caller; nothing here imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["forget_forward_stack", "is_zero3_partitioned", "zero3_partition"]


def is_zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built inside ``deepspeed.zero.Init`` (its parameters partitioned).

    Why private: DeepSpeed marks a partitioned parameter only by the attributes it adds to it
    (``ds_id``, ``ds_tensor``, ...); there is no public predicate. Such a module must not be
    moved with ``.to(device)`` before ``deepspeed.initialize``.
    """
    return any(hasattr(p, "ds_id") for p in module.parameters())


def forget_forward_stack(module: torch.nn.Module) -> None:
    """Let go of ``module`` in ZeRO-3's module-level state, so a dropped model can be freed.

    Why private: two module-level objects of DeepSpeed keep a ZeRO-3 model (and through it its
    parameters, engine and optimizer) alive for the life of the process, and neither
    ``engine.destroy()`` nor any public call clears them:

    - ``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``, the stack of modules in
      forward, keeps entries after a run's forwards;
    - ``PartitionedParameterCoordinator.__params_to_release`` is a method under
      ``functools.lru_cache``, whose class-wide cache keys hold the coordinator (``self``).

    Called only when the model is released, which no forward of it can follow. Clearing the
    cache costs the live models nothing but a recomputation.
    """
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        mine = {id(m) for m in module.modules()}
        stack[:] = [m for m in stack if id(m) not in mine]
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    cls = getattr(coordinator, "PartitionedParameterCoordinator", None)
    cached = _lru_cache_of(getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None))
    if cached is not None:
        cached.cache_clear()


def _lru_cache_of(function: Any) -> Any:
    """The ``functools.lru_cache`` wrapper inside ``function``'s decorators (DeepSpeed's
    ``instrument_w_nvtx`` keeps it in a closure cell, without ``__wrapped__``)."""
    for _ in range(4):
        if function is None or hasattr(function, "cache_clear"):
            return function
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            cells = [c.cell_contents for c in (getattr(function, "__closure__", None) or ())]
            inner = next((c for c in cells if callable(c)), None)
        function = inner
    return None


def zero3_partition(param: torch.Tensor) -> tuple[torch.Tensor, int, int, tuple[int, ...]] | None:
    """This rank's partition of a ZeRO-3 parameter: (its flat local tensor, the offset of its
    first element in the flattened full parameter, how many elements it holds, the full
    shape). None for a parameter that is not partitioned.

    Why private: loading pretrained weights into a partitioned model should read only this
    rank's elements from the file. DeepSpeed keeps the partition in ``param.ds_tensor``
    (rank r holds flat elements ``[r * ds_tensor.numel(), ...)`` of the parameter, zero-padded
    past ``ds_numel``), with no public accessor before the engine is built. Checked against
    deepspeed 0.19.8 (``Init._partition_param``).
    """
    local = getattr(param, "ds_tensor", None)
    if local is None or not hasattr(param, "ds_numel"):
        return None
    import torch.distributed as dist

    rank = dist.get_rank(group=param.ds_process_group) if dist.is_initialized() else 0
    size = local.numel()
    start = size * rank
    count = max(0, min(size, param.ds_numel - start))
    return local, start, count, tuple(param.ds_shape)
