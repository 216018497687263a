"""FSDP checkpoints: a folder of shards (``torch.distributed.checkpoint``) or one full file.

Sharded: every rank writes its own slices, nothing is gathered, and any number of FSDP ranks
can read the folder back (``torch.distributed.checkpoint`` reshards on load). The folder is
written under a temporary name and renamed into place by rank 0 once every rank is done, so a
crash leaves the previous checkpoint or the new one, never a mix. Full: the model and
optimizer are gathered to rank 0, which writes the same single file as the other strategies.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._io.consolidate import META_FILE
from scopedlite._io.files import (
    CheckpointError,
    read,
    restore,
    state_dicts,
    swap_folder_into_place,
    write_atomically,
)

if TYPE_CHECKING:
    from scopedlite._strategies.fsdp.strategy import FSDPStrategy

__all__ = ["load_file", "load_sharded", "save_full", "save_sharded"]


def _numpy_needed() -> None:
    # torch.distributed.checkpoint gathers its plan with gather_object, which needs numpy on
    # the receiving ranks in torch 2.13; without it a worker dies inside torch.
    try:
        import numpy  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "Sharded checkpoints need numpy (torch.distributed.checkpoint uses it): "
            "pip install scopedlite[fsdp]"
        ) from e


def save_sharded(strategy: FSDPStrategy, path: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )


    _numpy_needed()
    path = Path(path).absolute()
    kinds: dict[str, str] = {}
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            kinds[key], tensors[key] = "module", get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            kinds[key] = "optimizer"
            tensors[key] = get_optimizer_state_dict(strategy.owner_of(value), value)
        else:
            objects[key] = value
    rank_zero = strategy.placement.is_global_zero
    token = strategy.broadcast(secrets.token_hex(4) if rank_zero else None, src=0)
    staging = path.parent / f".{path.name}.{token}.tmp"
    if rank_zero:
        staging.mkdir(parents=True)
    strategy.barrier()
    try:
        dcp.save(tensors, checkpoint_id=staging)
        if rank_zero:
            meta = {"format": 1, "order": list(state), "kinds": kinds, "objects": objects}
            write_atomically(staging / META_FILE, meta)
            swap_folder_into_place(staging, path, token)
    except BaseException:
        if rank_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    strategy.barrier()


def save_full(strategy: FSDPStrategy, path: Path, state: dict[str, Any]) -> None:
    """Gather everything to rank 0 and write the single file the other strategies write."""

    converted = state_dicts(strategy, state)  # gathers: every rank takes part
    if strategy.placement.is_global_zero:
        write_atomically(path, converted)
    strategy.barrier()


def load_file(strategy: FSDPStrategy, path: Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Restore ``state`` from a single-file checkpoint: each rank reads it and keeps its slices."""

    checkpoint = read(path, weights_only=True)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path} holds a {type(checkpoint).__name__}, not the dict lite.save writes.")
    return restore(strategy, path, checkpoint, state, strict)


def load_sharded(strategy: FSDPStrategy, path: Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Restore ``state`` in place from the sharded checkpoint folder ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )


    _numpy_needed()
    if not (path / META_FILE).is_file():
        raise CheckpointError(f"{path} is a folder but not a sharded checkpoint written by lite.save (no {META_FILE}).")
    meta = read(path / META_FILE, weights_only=True)
    kinds, objects = meta["kinds"], meta["objects"]
    missing = [k for k in state if k not in kinds and k not in objects]
    if missing and strict:
        raise KeyError(
            f"{path} has no entry {missing}; it holds {meta['order']}. Pass strict=False to "
            "restore only what is there."
        )
    template: dict[str, Any] = {}
    for key, target in state.items():
        expected = "module" if isinstance(target, torch.nn.Module) else "optimizer"
        if key not in kinds or not isinstance(target, (torch.nn.Module, torch.optim.Optimizer)):
            continue
        if kinds[key] != expected:
            raise CheckpointError(f"{path}: entry {key!r} holds a {kinds[key]}, not a {expected}.")
        if isinstance(target, torch.nn.Module):
            template[key] = get_model_state_dict(target)
        else:
            template[key] = get_optimizer_state_dict(strategy.owner_of(target), target)
    dcp.load(template, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    for key, loaded in template.items():
        target = state[key]
        if isinstance(target, torch.nn.Module):
            set_model_state_dict(target, loaded, options=StateDictOptions(strict=strict))
        else:
            set_optimizer_state_dict(strategy.owner_of(target), target, loaded)
    for key in state:
        if key in objects and not isinstance(state[key], (torch.nn.Module, torch.optim.Optimizer)):
            state[key] = objects[key]
    return {k: v for k, v in objects.items() if k not in state}
