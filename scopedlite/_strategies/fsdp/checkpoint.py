"""Writing FSDP checkpoints: a folder of shards (``torch.distributed.checkpoint``) or one file.

Sharded: every rank writes its own slices, nothing is gathered; any strategy at any world
size reads the folder back (``_io.dcp_format``), each rank the slices it holds. The folder is
written under a temporary name and renamed into place by rank 0 once every rank is done, so a
crash leaves the previous checkpoint or the new one, never a mix. Full: the model and
optimizer are gathered to rank 0, which writes the same single file as the other strategies.

In the background (``lite.save(..., blocking=False)``, :func:`start_sharded`): the same folder
through ``torch.distributed.checkpoint.async_save``, which copies this rank's shards to the
CPU before it returns (into buffers kept from the previous save) and writes them in a thread;
its planning and completion messages travel on a process group of their own, so that they
never interleave with the training's collectives. Rank 0 writes the plain entries and swaps
the folder into place once every rank's shards are written, also in the background.
:func:`start_full` gathers now and writes the one file in the background.
"""

from __future__ import annotations

import secrets
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from scopedlite._io.background import Staging
from scopedlite._io.canonical import kinds_of
from scopedlite._io.dcp_format import META_FILE
from scopedlite._io.files import WriteAbandoned, state_dicts, swap_folder_into_place, write_atomically

if TYPE_CHECKING:
    from scopedlite._strategies.fsdp.strategy import FSDPStrategy

__all__ = ["save_full", "save_sharded", "start_full", "start_sharded"]

Work = Callable[[threading.Event], None]


def save_sharded(strategy: FSDPStrategy, path: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    path = Path(path).absolute()
    tensors, meta = _split(strategy, state)
    token, staging = _staging_folder(strategy, path)
    try:
        dcp.save(tensors, checkpoint_id=staging)
        if strategy.placement.is_global_zero:
            write_atomically(staging / META_FILE, meta)
            swap_folder_into_place(staging, path, token)
    except BaseException:
        if strategy.placement.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    strategy.barrier()


def start_sharded(strategy: FSDPStrategy, path: Path, state: dict[str, Any], staging: Staging) -> Work:
    """The sharded folder, written in the background: copied now, written by the thread."""
    import torch.distributed.checkpoint as dcp

    path = Path(path).absolute()
    tensors, meta = _split(strategy, state)
    rank_zero = strategy.placement.is_global_zero
    meta = staging.copy(meta) if rank_zero else None  # the plain entries as they are now
    token, folder = _staging_folder(strategy, path)
    try:
        written = dcp.async_save(
            tensors,
            checkpoint_id=folder,
            process_group=strategy.checkpoint_group(),
            async_stager=staging.stager,  # copies now, into the buffers of the previous save
        )
    except BaseException:
        if rank_zero:
            shutil.rmtree(folder, ignore_errors=True)
        raise

    def finish(stop: threading.Event) -> None:
        try:
            written.result()  # every rank's shards and DCP's metadata are written
            if rank_zero:
                if stop.is_set():
                    raise WriteAbandoned(f"the write of {path} was abandoned")
                write_atomically(folder / META_FILE, meta, stop)
                swap_folder_into_place(folder, path, token)
        except BaseException:
            if rank_zero:
                shutil.rmtree(folder, ignore_errors=True)
            raise

    return finish


def _split(strategy: FSDPStrategy, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors DCP writes (this rank's shards of each module and optimizer), and what
    rank 0 writes beside them (each entry's kind, the plain entries)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            tensors[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            tensors[key] = get_optimizer_state_dict(strategy.owner_of(value), value)
        else:
            objects[key] = value
    return tensors, {"format": 1, "order": list(state), "kinds": kinds_of(state), "objects": objects}


def _staging_folder(strategy: FSDPStrategy, path: Path) -> tuple[str, Path]:
    """The temporary folder beside ``path`` the ranks write into (made by rank 0; every rank
    returns once it exists), and its token."""
    rank_zero = strategy.placement.is_global_zero
    token = strategy.broadcast(secrets.token_hex(4) if rank_zero else None, src=0)
    folder = path.parent / f".{path.name}.{token}.tmp"
    if rank_zero:
        folder.mkdir(parents=True)
    strategy.barrier()
    return token, folder


def save_full(strategy: FSDPStrategy, path: Path, state: dict[str, Any]) -> None:
    """Gather everything to rank 0 and write the single file the other strategies write."""

    converted = state_dicts(strategy, state)  # gathers: every rank takes part
    if strategy.placement.is_global_zero:
        write_atomically(path, converted)
    strategy.barrier()


def start_full(strategy: FSDPStrategy, path: Path, state: dict[str, Any], staging: Staging) -> Work | None:
    """The single file, gathered now (every rank takes part) and written by rank 0's thread."""
    converted = state_dicts(strategy, state)
    if not strategy.placement.is_global_zero:
        return None
    copied = staging.copy(converted)
    target = Path(path).absolute()
    return lambda stop: write_atomically(target, copied, stop)
