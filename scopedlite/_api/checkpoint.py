"""``lite.save`` / ``lite.load``: one file, written once and atomically, loaded safely.

Rank 0 writes the file to a temporary name in the same folder, syncs it to disk and renames
it over the target, so a crash at any moment leaves either the previous checkpoint or the
new one, never half a file. Loading uses ``weights_only=True`` unless asked otherwise by
name: a checkpoint is data, and unpickling arbitrary objects runs arbitrary code.

A loader from ``setup_dataloader`` may be an entry of the state: what is saved is every
rank's position in its pass and random states (see ``loader_state``), and loading makes the
loader's next pass continue where the saved one stopped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from scopedlite._api.collectives import barrier, broadcast
from scopedlite._api.current import current
from scopedlite._api.dataloader import DeviceDataLoader
from scopedlite._api.join import in_join
from scopedlite._api.loader_state import FORMAT
from scopedlite._core.structures import map_tensors
from scopedlite._io.files import (
    CheckpointError,
    read,
    restore,
    state_dicts,
    write_atomically,
)
from scopedlite._strategies.abilities import SupportsCheckpoint

__all__ = ["CheckpointError", "load", "save"]


def save(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Save ``state`` to ``path``: modules and optimizers as state dicts, the rest as is.

    Every rank calls it; rank 0 writes; all ranks return once the file is complete. A loader
    from ``lite.setup_dataloader`` is saved as every rank's position and random states.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict such as {{'model': model, 'opt': opt}}, got {type(state).__name__}.")
    state = {key: _loader_entry(key, value) for key, value in state.items()}
    run = current()
    strategy = run.strategy
    if isinstance(strategy, SupportsCheckpoint):  # its own (sharded) checkpoint format
        strategy.save_checkpoint(path, state)
        return
    converted = state_dicts(strategy, state)
    if run.is_global_zero:
        write_atomically(Path(path), converted)
    barrier()


def load(
    path: str | os.PathLike[str],
    state: dict[str, Any] | None = None,
    *,
    strict: bool = True,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save`.

    Modules and optimizers in ``state`` are restored in place; other entries of ``state`` are
    replaced by the checkpoint's values. A loader from ``lite.setup_dataloader`` stays in
    ``state``: its next pass continues the saved one from the first batch not yet seen, and
    the random states of torch, numpy and Python are those of the save (each rank its own).

    Args:
        path: The checkpoint file.
        state: What to restore, e.g. ``{"model": model, "opt": opt, "step": 0}``. None
            returns the whole checkpoint.
        strict: Require module state dict keys to match exactly, and every key of ``state``
            to be in the checkpoint.
        weights_only: Refuse to unpickle anything but tensors and plain containers.

    Returns:
        What the checkpoint held that ``state`` did not ask for.
    """
    loaders = {k: v for k, v in (state or {}).items() if isinstance(v, DeviceDataLoader)}
    if state is not None and loaders:
        work = {k: (None if k in loaders else v) for k, v in state.items()}
        rest = _load(path, work, strict, weights_only)
        run = current()
        for key, value in work.items():
            if key in loaders:
                if value is not None:  # absent only with strict=False: the loader stays as it is
                    loaders[key]._lite_load_state(value, run.data_parallel_rank, run.data_parallel_size)
            else:
                state[key] = value
        return rest
    return _load(path, state, strict, weights_only)


def _loader_entry(key: str, value: Any) -> Any:
    """A loader of ``setup_dataloader`` as checkpoint data: every rank's state (a collective).

    One state per share of the data (per data-parallel rank): the tensor-parallel ranks of a
    replica (``model_parallel``) read the same batches, and the first of them speaks for all,
    so a checkpoint's shares are those the data was dealt into, whatever the strategy.
    """
    if isinstance(value, DataLoader):
        raise TypeError(
            f"state[{key!r}] is a plain DataLoader; only the loader lite.setup_dataloader returns "
            "knows its position and can be saved: `loader = lite.setup_dataloader(loader)`."
        )
    if not isinstance(value, DeviceDataLoader):
        return value
    unstarted = value._lite_unstarted_entry()
    if unstarted is not None:  # loaded, and stopped again before the resumed pass began
        return unstarted
    local = value._lite_local_state()
    run = current()
    try:
        shares = [broadcast((run.data_parallel_rank, local), src=r) for r in range(run.world_size)]
    except RuntimeError as e:
        if not in_join():
            raise
        raise RuntimeError(
            f"lite.save could not collect every rank's position of state[{key!r}] inside "
            "lite.join: a rank that ran out of data has left the loop. Save after the join "
            "block, where every rank takes part (docs/preemption.md shows the loop)."
        ) from e
    by_share: dict[int, Any] = {}
    for share, state in shares:
        by_share.setdefault(int(share), map_tensors(state, lambda t: t.cpu()))
    ranks = [by_share[share] for share in range(run.data_parallel_size)]
    return {"format": FORMAT, "world_size": run.data_parallel_size, "ranks": ranks}


def _load(
    path: str | os.PathLike[str], state: dict[str, Any] | None, strict: bool, weights_only: bool
) -> dict[str, Any]:
    run = current()
    strategy = run.strategy
    if isinstance(strategy, SupportsCheckpoint) and state is not None:  # its own checkpoint format
        if not weights_only:
            raise ValueError(
                f"lite.load(weights_only=False) is not available under strategy="
                f"{strategy.name!r}: the strategy reads its own sharded checkpoint format "
                "and does not take this option. Drop the argument."
            )
        return strategy.load_checkpoint(path, state, strict)
    checkpoint = read(path, weights_only)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path} holds a {type(checkpoint).__name__}, not the dict lite.save writes.")
    if state is None:
        return checkpoint
    return restore(strategy, path, checkpoint, state, strict)
