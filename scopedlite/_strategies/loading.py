"""Loading a checkpoint (in the canonical form of ``_io.canonical``) into torch modules and
optimizers whose tensors are whole on every rank (single, ddp) or DTensors (fsdp): each rank
reads, of every tensor, the part it holds.

A module whose tensors are all whole goes through its own ``load_state_dict``, so the
module's load hooks run as in plain torch. A sharded module is written in place, slice by
slice: no rank ever holds more of the checkpoint than one slice of one tensor beyond what
it keeps. An optimizer gets its state by parameter name, each tensor shaped (and sharded)
like its parameter, through ``optimizer.load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from scopedlite._core.dtensors import dtensor_class
from scopedlite._io.canonical import Box, OptimizerEntry, TensorInfo, Tensors
from scopedlite._io.files import CheckpointError
from scopedlite._private.torch_internals import local_box

__all__ = ["check_keys", "check_shape", "load_module", "load_optimizer", "parameter_names"]


def check_keys(expected: Sequence[str], tensors: Tensors, strict: bool, what: str) -> list[str]:
    """The keys to load; with ``strict``, refuse (as ``load_state_dict`` does) when the
    checkpoint's keys and the module's differ."""
    available = set(tensors.info) | set(tensors.extras)
    missing = [k for k in expected if k not in available]
    unexpected = sorted(str(k) for k in available - set(expected))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {what}: missing key(s) {missing}, unexpected "
            f"key(s) {unexpected}. Pass strict=False to load the keys both have."
        )
    return [k for k in expected if k in available]


def check_shape(key: Hashable, info: TensorInfo, shape: Sequence[int]) -> None:
    """Refuse a checkpoint tensor whose shape is not the model's."""
    if tuple(info.shape) != tuple(shape):
        raise CheckpointError(
            f"size mismatch for {key}: the checkpoint holds shape {tuple(info.shape)}, the model "
            f"{tuple(shape)}. Build the model as the run that saved it did."
        )


def load_module(module: torch.nn.Module, tensors: Tensors, strict: bool) -> None:
    """Load ``tensors`` (a module entry) into ``module``, each rank reading what it holds."""
    targets = module.state_dict(keep_vars=True)
    dtensor = dtensor_class()
    if dtensor is None or not any(isinstance(v, dtensor) for v in targets.values()):
        keys = [k for k in targets if k in tensors.info] if not strict else list(tensors.info)
        state = dict(zip(keys, tensors.read_many([(k, None) for k in keys])))
        module.load_state_dict({**state, **tensors.extras}, strict=strict)
        return
    keys = check_keys(list(targets), tensors, strict, type(module).__name__)
    with torch.no_grad():
        for key in keys:
            target = targets[key]
            if not isinstance(target, torch.Tensor):
                raise CheckpointError(
                    f"{type(module).__name__}.{key} is extra state (get_extra_state), which a "
                    "sharded model cannot load from a checkpoint; load it before sharding."
                )
            check_shape(key, tensors.info[key], target.shape)
            if isinstance(target, dtensor):
                offsets, sizes = local_box(target)
                target.to_local().copy_(tensors.read(key, Box(offsets, sizes)))
            else:
                target.copy_(tensors.read(key))


def parameter_names(optimizer: torch.optim.Optimizer, modules: Sequence[torch.nn.Module]) -> list[list[str]] | None:
    """The names of the optimizer's parameters, group by group, found in ``modules``; None
    when some parameter is in none of them."""
    names = {id(p): n for module in modules for n, p in module.named_parameters()}
    groups = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    if any(n is None for group in groups for n in group):
        return None
    return groups  # type: ignore[return-value]


def load_optimizer(optimizer: torch.optim.Optimizer, entry: OptimizerEntry, names: list[list[str]] | None) -> None:
    """Load ``entry`` into ``optimizer`` by parameter name (``names``: its parameters' names
    per group), each state tensor read and sharded like its parameter. Without names, an
    entry keyed by position (a file written by ``optimizer.state_dict()``) loads by position,
    as in plain torch."""
    if names is None:
        if not entry.keyed_by_position:
            raise CheckpointError(
                "This checkpoint keeps the optimizer's state by parameter name, and the optimizer's "
                "parameters are not those of a model loaded with it. Load the optimizer together "
                "with its model: lite.load(path, {'model': model, 'opt': opt})."
            )
        names = [[f"{i}.{j}" for j, _ in enumerate(g["params"])] for i, g in enumerate(optimizer.param_groups)]
    flat = [n for group in names for n in group]
    entry = entry.by_name(flat)
    entry.check_groups(names)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {name: i for i, name in enumerate(flat)}
    state = {}
    for name, values in entry.state.items():
        param = params[index[name]]
        state[index[name]] = {
            k: _like(entry.tensors, (name, k), v, param) if isinstance(v, TensorInfo) else v for k, v in values.items()
        }
    groups = [{**entry.hyperparameters(g), "params": [index[n] for n in group]} for g, group in enumerate(names)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _like(tensors: Tensors, key: Hashable, info: TensorInfo, param: torch.Tensor) -> torch.Tensor:
    """The tensor ``key``, shaped and sharded like ``param`` (a new tensor of this rank's own)."""
    check_shape(key, info, param.shape)
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(param, dtensor):
        offsets, sizes = local_box(param)
        local = tensors.read(key, Box(offsets, sizes)).to(param.device, copy=True)
        return dtensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return tensors.read(key).to(param.device, copy=True)
