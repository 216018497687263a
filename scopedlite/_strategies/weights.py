"""Pretrained weights into a set-up model, each rank reading only what it holds.

What a rank holds depends on how the strategy keeps the tensor, and this module reads it
from the tensor itself:

- an FSDP2 ``DTensor`` sharded along its first dimension: this rank's rows, read alone
  (any other placement: the full tensor, one at a time, and this rank's part cut from it);
- a ZeRO-3 partitioned parameter: this rank's flat range of elements, read from the rows
  that hold them;
- anything else (single, DDP, ZeRO 1-2 replicas, buffers): the full tensor.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from scopedlite._core.dtensors import shard_like
from scopedlite._io.pretrained import PretrainedWeights
from scopedlite._private.deepspeed_internals import zero3_local_part

__all__ = ["load_weights"]


def load_weights(module: torch.nn.Module, weights: PretrainedWeights, strict: bool) -> None:
    """Copy ``weights`` into ``module``'s parameters and persistent buffers, by name.

    A tensor known under several names (tied weights) is read once, from whichever of its
    names the file has (``save_pretrained`` writes one of them).

    Raises:
        ValueError: With ``strict``, a tensor of the module that the file lacks or a tensor of
            the file that the module lacks; in any case, a shape that differs.
    """
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            groups.setdefault(id(tensor), (tensor, []))[1].append(name)
    available = weights.names()
    missing = [names[0] for _, names in groups.values() if not any(n in available for n in names)]
    unexpected = sorted(available - {n for _, names in groups.values() for n in names})
    if strict and (missing or unexpected):
        raise ValueError(
            f"The weights at {weights.path} do not match the {type(module).__name__}: missing "
            f"{sorted(missing)[:10]}{' ...' if len(missing) > 10 else ''}, unexpected "
            f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}. Build the model from "
            "the same config (`Model(AutoConfig.from_pretrained(path))`), or pass strict=False "
            "to load the names both have and keep the others as they are."
        )
    with torch.no_grad():
        for tensor, names in groups.values():
            name = next((n for n in names if n in available), None)
            if name is not None:
                _fill(tensor, weights, name)


def _fill(tensor: torch.Tensor, weights: PretrainedWeights, name: str) -> None:
    shape = weights.shape(name)
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no tensor is a DTensor
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        _check_shape(name, shape, tuple(tensor.shape))
        _fill_dtensor(tensor, weights, name, dtensor)
        return
    partition = zero3_local_part(tensor)
    if partition is not None:
        local, start, count, full_shape = partition
        _check_shape(name, shape, full_shape)
        local[:count].copy_(weights.flat(name, start, count))
        return
    _check_shape(name, shape, tuple(tensor.shape))
    tensor.copy_(weights.full(name))


def _fill_dtensor(tensor: Any, weights: PretrainedWeights, name: str, dtensor: Any) -> None:
    local = tensor.to_local()
    mesh = tensor.device_mesh
    if mesh.ndim == 1 and tuple(tensor.placements) == (dtensor.Shard(0),) and tensor.ndim > 0:
        # FSDP2 cuts the first dimension as torch.chunk does: chunks of ceil(n / ranks) rows.
        rows = tensor.shape[0]
        chunk = math.ceil(rows / mesh.size())
        start = min(mesh.get_local_rank() * chunk, rows)
        stop = min(start + chunk, rows)
        if stop - start == local.shape[0]:
            local.copy_(weights.rows(name, start, stop))
            return
    full = weights.full(name).to(device=local.device, dtype=local.dtype)
    local.copy_(shard_like(full, tensor).to_local())


def _check_shape(name: str, stored: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(stored) != tuple(expected):
        raise ValueError(
            f"{name} has shape {list(stored)} in the weights but {list(expected)} in the model: "
            "build the model from the config the weights were saved with."
        )
