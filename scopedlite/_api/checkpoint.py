"""``lite.save`` / ``lite.load``: one file, written once and atomically, loaded safely.

Rank 0 writes the file to a temporary name in the same folder, syncs it to disk and renames
it over the target, so a crash at any moment leaves either the previous checkpoint or the
new one, never half a file. Loading uses ``weights_only=True`` unless asked otherwise by
name: a checkpoint is data, and unpickling arbitrary objects runs arbitrary code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scopedlite._api.collectives import barrier
from scopedlite._api.current import current
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

    Every rank calls it; rank 0 writes; all ranks return once the file is complete.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict such as {{'model': model, 'opt': opt}}, got {type(state).__name__}.")
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
    replaced by the checkpoint's values.

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
