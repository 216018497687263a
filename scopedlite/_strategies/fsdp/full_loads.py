"""A plain (full) state dict loaded into a sharded model or optimizer takes each rank's shard.

A script written for DDP resumes with ``model.load_state_dict(torch.load(path))`` and
``opt.load_state_dict(...)`` on every rank, from a file plain torch wrote: full tensors. Under
fsdp and model_parallel the set-up model's parameters are DTensors, each rank holding a shard.
Torch refused the model's load ("got mixed torch.Tensor and DTensor", after copying the
one-element tensors it could replicate), and took the optimizer's as it was: the momenta
stayed full tensors, and the next ``opt.step()`` failed on the same mix.

So the set-up model and each set-up optimizer get a ``load_state_dict`` pre-hook (torch's
public hooks; removed when the run ends) that replaces each plain tensor whose shape is the
full shape of its DTensor parameter with this rank's shard of it, laid out as the parameter
is (``distribute_tensor`` with ``src_data_rank=None``: each rank cuts its own shard from the
full tensor it holds, no communication). Every rank loaded the same file, so the shards form
the full value, as ``set_model_state_dict(..., full_state_dict=True)`` would give. The load
then goes on as torch's own. DTensors (a sharded state dict of this run) and tensors of other
shapes (an optimizer's ``step``) are left as they are. A load on some ranks only is refused
before this (``_api/loads.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._core.dtensors import is_dtensor, shard_like

__all__ = ["shard_full_model_state", "shard_full_optimizer_state"]


def shard_full_model_state(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A ``load_state_dict`` pre-hook of the sharded root: full values become shards, in place
    (in torch's own copy of the dict the user passed)."""
    for name, param in module.named_parameters():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _shard_of(state_dict[key], param)


def shard_full_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``load_state_dict`` pre-hook: the same for each parameter's state (its
    momenta), matched to the parameters by their order in the groups, as torch matches them.
    Returns a new dict; the one passed stays the user's."""
    saved_groups, state = state_dict.get("param_groups", []), state_dict.get("state", {})
    shards = dict(state)
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for key, param in zip(saved["params"], group["params"]):
            if key in state and is_dtensor(param):
                shards[key] = {name: _shard_of(value, param) for name, value in state[key].items()}
    return {**state_dict, "state": shards}


def _shard_of(value: Any, param: Any) -> Any:
    """``value``'s shard laid out as ``param``'s, where ``value`` is a plain tensor of the full
    shape of the DTensor ``param``; otherwise ``value``."""
    if not is_dtensor(param) or not isinstance(value, torch.Tensor) or is_dtensor(value):
        return value
    if tuple(value.shape) != tuple(param.shape):
        return value
    return shard_like(value.detach(), param)
