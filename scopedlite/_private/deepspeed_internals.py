"""Every use of DeepSpeed's private API, in one place, each with the reason it is unavoidable.

Checked against deepspeed 0.19.8. DeepSpeed is imported by the caller; the functions that
work on a live engine import what they use of it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ZeroSlot",
    "forget_forward_stack",
    "full_shape",
    "is_zero3_parameter",
    "is_zero3_partitioned",
    "pickled_classes_readable",
    "write_zero3_partition",
    "zero3_local_part",
    "zero3_partition",
    "zero_slots",
]


def is_zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built inside ``deepspeed.zero.Init`` (its parameters partitioned).

    Why private: DeepSpeed marks a partitioned parameter only by the attributes it adds to it
    (``ds_id``, ``ds_tensor``, ...); there is no public predicate. Such a module must not be
    moved with ``.to(device)`` before ``deepspeed.initialize``.
    """
    return any(hasattr(p, "ds_id") for p in module.parameters())


def is_zero3_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partitioned parameter (gathered only inside forward or
    ``deepspeed.zero.GatheredParameters``).

    Why private: as for :func:`is_zero3_partitioned`, DeepSpeed marks such a parameter only by
    the attributes it adds to it; ``ds_numel`` (the whole parameter's element count) is one.
    Checked against deepspeed 0.19.8 (``Init._convert_to_deepspeed_param``).
    """
    return hasattr(param, "ds_numel")


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


# -- reading DeepSpeed's checkpoint files ----------------------------------------------------

# The classes DeepSpeed pickles into a ZeRO checkpoint's optimizer files, by import path.
_PICKLED = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class Pickled:
    """Stands in for one of DeepSpeed's pickled objects: keeps its arguments and state."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str) -> Any:
        return (self.state or {})[name]


@contextlib.contextmanager
def pickled_classes_readable() -> Iterator[None]:
    """Let ``torch.load(weights_only=True)`` read DeepSpeed's optimizer files, each of its
    classes replaced by :class:`Pickled`.

    Why private: the files name DeepSpeed's internal classes (a stage enum, the loss scaler,
    the position of each parameter's fragment). Reading them through stand-ins needs neither
    DeepSpeed installed nor an unpickler that runs arbitrary code. Checked against 0.19.8.
    """
    with torch.serialization.safe_globals([(Pickled, name) for name in _PICKLED]):
        yield


# -- loading into a ZeRO engine -------------------------------------------------------------


@dataclass(frozen=True)
class ZeroSlot:
    """Where this rank keeps its part of one parameter's fp32 master copy and optimizer state.

    Attributes:
        param: The model's parameter.
        flat: A flat fp32 partition: one parameter of the torch optimizer inside the engine,
            whose state (``optimizer.state[flat]``) holds the moments of every parameter in it.
        offset: Where the part starts in ``flat``.
        start: Where the part starts in the flattened parameter.
        numel: Its length (0 where this rank holds none of the parameter).
        group: The index of the user's param group the parameter is in.
    """

    param: torch.nn.Parameter
    flat: torch.Tensor
    offset: int
    start: int
    numel: int
    group: int


def zero_slots(zero_optimizer: Any) -> list[ZeroSlot]:
    """Every trainable parameter's slot in a ZeRO optimizer of stage 1, 2 or 3, group by group.

    Why private: loading a checkpoint of another layout (another world size, stage or
    strategy) means writing each rank's part of each parameter and of its optimizer state
    where the engine keeps it, and the optimizer's state may not exist yet (torch creates it
    at the first step). DeepSpeed's ``safe_set_local_*`` functions write into existing state
    only, and its universal-checkpoint loader reads files in its own format only. The layout
    read here: ZeRO-3 keeps each sub-group's parameters' partitions back to back in
    ``fp32_partitioned_groups_flat[i]`` (``fp16_groups[i]`` in order, ``partition_numel()``
    each, ``sub_group_to_group_id`` naming the user's group); ZeRO-1/2 keep one flat partition
    per group (``single_partition_of_fp32_groups``), each parameter's fragment described by
    ``param._hp_mapping``. Checked against 0.19.8.
    """
    slots: list[ZeroSlot] = []
    if not hasattr(zero_optimizer, "bit16_groups") and not hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):
        raise NotImplementedError(f"a ZeRO optimizer of type {type(zero_optimizer).__name__}")
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        if getattr(zero_optimizer, "swap_optimizer", False):
            raise NotImplementedError("optimizer state swapped to NVMe")
        for index, params in enumerate(zero_optimizer.fp16_groups):
            flat = zero_optimizer.fp32_partitioned_groups_flat[index]
            group = zero_optimizer.sub_group_to_group_id[index]
            offset = 0
            for param in params:
                start, numel, size = zero3_partition(param)
                slots.append(ZeroSlot(param, flat, offset, start, numel, group))
                offset += size
        return slots
    for group, params in enumerate(zero_optimizer.bit16_groups):
        flat = zero_optimizer.single_partition_of_fp32_groups[group]
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:  # the whole parameter lies in other ranks' partitions
                slots.append(ZeroSlot(param, flat, 0, 0, 0, group))
                continue
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            slots.append(ZeroSlot(param, flat, hp.start, lp.start, lp.numel, group))
    return slots


def zero3_partition(param: torch.nn.Parameter) -> tuple[int, int, int]:
    """``(start, numel, size)``: the part of a ZeRO-3 parameter this rank holds in
    ``param.ds_tensor`` (``size`` elements, the last rank's padded past ``numel``).

    Why private: DeepSpeed has no public accessor for a parameter's partition."""
    import torch.distributed as dist

    size = param.partition_numel()
    # deepspeed.comm.get_rank(group) is this, once DeepSpeed's comm is set up; a model built
    # by sharded_init is partitioned before any engine set it up.
    rank = dist.get_rank(group=param.ds_process_group) if dist.is_initialized() else 0
    start = min(rank * size, param.ds_numel)
    return start, max(0, min(size, param.ds_numel - start)), size


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """The shape of the whole parameter, also where ZeRO-3 holds only a partition of it.

    Why private: a partitioned parameter's ``shape`` is that of an empty placeholder; the
    whole shape is kept in ``param.ds_shape``."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def write_zero3_partition(param: torch.nn.Parameter, part: torch.Tensor, whole: Any) -> None:
    """Write this rank's part of a ZeRO-3 parameter (its low-precision copy, what forward
    gathers), and, where DeepSpeed keeps the whole parameter gathered (small "persistent"
    parameters, or one gathered right now), the whole value too (``whole()`` reads it).

    Why private: the partition lives in ``param.ds_tensor`` and the gathered value in
    ``param.data`` while ``param.ds_status`` is AVAILABLE; DeepSpeed's public way to change a
    parameter (``GatheredParameters(modifier_rank=...)``) gathers it whole on every rank and
    broadcasts it, one parameter at a time. Checked against 0.19.8.
    """
    with torch.no_grad():
        param.ds_tensor.data.view(-1)[: part.numel()].copy_(part)
        if param.ds_status.name == "AVAILABLE" and param.data.numel() == param.ds_numel:
            param.data.copy_(whole().view(param.data.shape))


def zero3_local_part(param: torch.Tensor) -> tuple[torch.Tensor, int, int, torch.Size] | None:
    """This rank's partition of a ZeRO-3 parameter: (its flat local tensor, the offset of its
    first element in the flattened full parameter, how many elements it holds, the full
    shape). None for a parameter that is not partitioned.

    Why private: loading pretrained weights into a partitioned model should read only this
    rank's elements from the file; DeepSpeed keeps the partition in ``param.ds_tensor`` (see
    :func:`zero3_partition`), with no public accessor before the engine is built. Checked
    against deepspeed 0.19.8 (``Init._partition_param``).
    """
    local = getattr(param, "ds_tensor", None)
    if local is None or not hasattr(param, "ds_numel"):
        return None
    start, numel, _ = zero3_partition(param)  # type: ignore[arg-type]
    return local, start, numel, full_shape(param)  # type: ignore[arg-type]
