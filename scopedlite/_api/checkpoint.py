"""``lite.save`` / ``lite.load``: written once and atomically, loaded safely, anywhere.

Under single and ddp (and fsdp with ``state_dict_type="full"``) rank 0 writes one file to a
temporary name in the same folder, syncs it to disk and renames it over the target, so a
crash at any moment leaves either the previous checkpoint or the new one, never half a file.
Under fsdp (sharded) and deepspeed the strategy writes a folder of its own format, with the
same guarantee.

``lite.load`` reads every one of these formats under every strategy and world size: the
checkpoint is opened in one canonical form (``_io.canonical``: tensors by name, read in
parts; optimizer state by parameter name) and each strategy loads the part each rank holds.
Loading uses ``weights_only=True`` unless asked otherwise by name: a checkpoint is data, and
unpickling arbitrary objects runs arbitrary code.

A loader from ``setup_dataloader`` may be an entry of the state: what is saved is every
rank's position in its pass and random states (see ``loader_state``), and loading makes the
loader's next pass continue where the saved one stopped.

``lite.save(path, state, blocking=False)`` copies the state and writes it in the background
(``checkpoint_background``); the next save and every load wait for it first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch.utils.data import DataLoader

from scopedlite._api.checkpoint_background import refuse_background, run_saves, start_save
from scopedlite._api.checkpoint_path import check_same_path
from scopedlite._api.collectives import barrier
from scopedlite._api.current import current
from scopedlite._api.dataloader import DeviceDataLoader
from scopedlite._api.missing_entries import missing_entries
from scopedlite._api.state_dict_file import as_entries
from scopedlite._io.background import SaveHandle
from scopedlite._io.canonical import OBJECT, Checkpoint, without_wrapper_prefix
from scopedlite._io.files import CheckpointError, state_dicts, write_atomically
from scopedlite._io.reader import open_checkpoint
from scopedlite._strategies.abilities import SupportsCheckpoint, SupportsNativeLoad
from scopedlite._strategies.base import Strategy
from scopedlite._strategies.join.members import in_join

__all__ = ["CheckpointError", "load", "save"]


@overload
def save(path: str | os.PathLike[str], state: dict[str, Any], *, blocking: Literal[True] = ...) -> None: ...
@overload
def save(path: str | os.PathLike[str], state: dict[str, Any], *, blocking: Literal[False]) -> SaveHandle: ...
@overload
def save(path: str | os.PathLike[str], state: dict[str, Any], *, blocking: bool) -> SaveHandle | None: ...


def save(path: str | os.PathLike[str], state: dict[str, Any], *, blocking: bool = True) -> SaveHandle | None:
    """Save ``state`` to ``path``: modules and optimizers as state dicts, the rest as is.

    Every rank calls it, with the same ``path`` (refused at once on every rank otherwise);
    rank 0 writes (under fsdp, model_parallel and deepspeed every rank writes its part of a
    folder); the checkpoint appears at ``path`` atomically. A loader from
    ``lite.setup_dataloader`` is saved as every rank's position and random states.

    Args:
        path: The file (or folder) to write.
        state: What to save, e.g. ``{"model": model, "opt": opt, "step": step}``.
        blocking: True: return once the checkpoint is complete. False: return as soon as
            every rank has copied its part to the CPU (the checkpoint holds the state as it
            is at this call) and write it in the background; the next ``save``, a ``load``
            and the end of the launch block wait for it, and raise its error if it failed.
            Not under deepspeed (refused).

    Returns:
        None, or with ``blocking=False`` a :class:`SaveHandle`: ``handle.wait()`` (on every
        rank) returns once the checkpoint is in place, or raises why it is not.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict such as {{'model': model, 'opt': opt}}, got {type(state).__name__}.")
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, got {blocking!r}.")
    run = current()
    if not blocking:
        refuse_background(run)
    check_same_path(path, "lite.save")
    saves = run_saves()
    saves.wait()  # the save in flight first: one at a time, and its error is raised here
    state = {key: _loader_entry(key, value) for key, value in state.items()}
    if not blocking:
        return start_save(run, path, state, saves)
    strategy = run.strategy
    if isinstance(strategy, SupportsCheckpoint):  # its own (sharded) checkpoint format
        strategy.save_checkpoint(path, state)
        return None
    converted = state_dicts(strategy, state)
    if run.is_global_zero:
        write_atomically(Path(path), converted)
    barrier()
    return None


def load(
    path: str | os.PathLike[str],
    state: dict[str, Any] | None = None,
    *,
    strict: bool = True,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` under any strategy and world size.

    Modules and optimizers in ``state`` are restored in place (each rank reads the part it
    holds; optimizer states are matched by parameter name); other entries of ``state`` are
    replaced by the checkpoint's values. A loader from ``lite.setup_dataloader`` stays in
    ``state``: its next pass continues the saved one from the first batch not yet seen, and
    the random states of torch, numpy and Python are those of the save (each rank its own).

    Every rank calls it, with the same ``path`` (refused at once on every rank otherwise).
    A save still being written in the background is waited for first.

    Args:
        path: The checkpoint: a file, or the folder fsdp (sharded) or deepspeed wrote.
        state: What to restore, e.g. ``{"model": model, "opt": opt, "step": 0}``. None
            returns the whole checkpoint, as the single file ``lite.consolidate_checkpoint``
            would write holds it.
        strict: Require module state dict keys to match exactly, and every key of ``state``
            to be in the checkpoint.
        weights_only: Refuse to unpickle anything but tensors and plain containers.

    Returns:
        What the checkpoint held that ``state`` did not ask for (from a folder: its plain
        entries; models and optimizers are read only into ``state``).
    """
    check_same_path(path, "lite.load")
    run_saves().wait()
    loaders = {k: v for k, v in (state or {}).items() if isinstance(v, DeviceDataLoader)}
    if state is not None and loaders:
        work = {k: (None if k in loaders else v) for k, v in state.items()}
        rest = _load(path, work, strict, weights_only)
        for key, value in work.items():
            if key in loaders:
                if value is not None:  # absent only with strict=False: the loader stays as it is
                    loaders[key].cursor.load(value)
            else:
                state[key] = value
        return rest
    return _load(path, state, strict, weights_only)


def _loader_entry(key: str, value: Any) -> Any:
    """A loader of ``setup_dataloader`` as checkpoint data: every rank's state (a collective)."""
    if isinstance(value, DataLoader):
        raise TypeError(
            f"state[{key!r}] is a plain DataLoader; only the loader lite.setup_dataloader returns "
            "knows its position and can be saved: `loader = lite.setup_dataloader(loader)`."
        )
    if not isinstance(value, DeviceDataLoader):
        return value
    try:
        return value.cursor.state()
    except RuntimeError as e:
        if not in_join():
            raise
        raise RuntimeError(
            f"lite.save could not collect every rank's position of state[{key!r}] inside "
            "lite.join: a rank that ran out of data has left the loop. Save after the join "
            "block, where every rank takes part (docs/preemption.md shows the loop)."
        ) from e


def _load(
    path: str | os.PathLike[str], state: dict[str, Any] | None, strict: bool, weights_only: bool
) -> dict[str, Any]:
    strategy = current().strategy
    with open_checkpoint(path, weights_only) as checkpoint:
        if state is None:
            return checkpoint.whole()
        entries = as_entries(checkpoint, state, strict)
        native = strategy.load_native(entries, state, strict) if isinstance(strategy, SupportsNativeLoad) else []
        return _restore(strategy, entries, state, strict, native)


def _restore(
    strategy: Strategy, checkpoint: Checkpoint, state: dict[str, Any], strict: bool, loaded: list[str]
) -> dict[str, Any]:
    """Restore ``state`` in place from ``checkpoint`` (any format): each module and optimizer
    through the strategy, which reads the part of each tensor this rank holds; the other
    entries replaced by the checkpoint's values. Returns what else the checkpoint held (from
    a folder, its plain entries: models and optimizers are not read unasked). ``loaded``:
    the keys the strategy already restored its own way."""
    missing = [k for k in state if k not in checkpoint and k not in loaded]
    if missing and strict:
        raise KeyError(missing_entries(checkpoint, state, missing))
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    for key, target in state.items():
        if key not in checkpoint or key in loaded:
            continue
        if isinstance(target, torch.nn.Module):
            tensors = without_wrapper_prefix(checkpoint.module(key), lambda m=target: m.state_dict(keep_vars=True))
            strategy.load_module_from(target, tensors, strict)
        elif isinstance(target, torch.optim.Optimizer):
            strategy.load_optimizer_from(target, checkpoint.optimizer(key), modules)
        else:
            state[key] = checkpoint.entry(key)
    plain = checkpoint.written_by == "file"
    return {
        k: checkpoint.entry(k) for k, kind in checkpoint.kinds.items() if k not in state and (plain or kind == OBJECT)
    }
