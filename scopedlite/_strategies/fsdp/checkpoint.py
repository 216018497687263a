"""Writing FSDP checkpoints: a folder of shards (``torch.distributed.checkpoint``) or one file.

Sharded: every rank writes its own slices, nothing is gathered; any strategy at any world
size reads the folder back (``_io.dcp_format``), each rank the slices it holds. The folder is
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

from scopedlite._io.canonical import kinds_of
from scopedlite._io.dcp_format import META_FILE
from scopedlite._io.files import state_dicts, swap_folder_into_place, write_atomically

if TYPE_CHECKING:
    from scopedlite._strategies.fsdp.strategy import FSDPStrategy

__all__ = ["save_full", "save_sharded"]


def save_sharded(strategy: FSDPStrategy, path: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    path = Path(path).absolute()
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            tensors[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
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
            meta = {"format": 1, "order": list(state), "kinds": kinds_of(state), "objects": objects}
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
