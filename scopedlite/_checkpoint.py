"""``lite.save`` / ``lite.load``: one file, written once and atomically, loaded safely.

Rank 0 writes the file to a temporary name in the same folder, syncs it to disk and renames
it over the target, so a crash at any moment leaves either the previous checkpoint or the
new one, never half a file. Loading uses ``weights_only=True`` unless asked otherwise by
name: a checkpoint is data, and unpickling arbitrary objects runs arbitrary code.
"""

from __future__ import annotations

import os
import pickle
import secrets
from pathlib import Path
from typing import Any

import torch

from scopedlite._collectives import barrier
from scopedlite._run import current

__all__ = ["CheckpointError", "load", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be read: truncated, not a torch checkpoint, or unsafe."""


def _is_stateful(obj: Any) -> bool:
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def save(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Save ``state`` to ``path``: modules and optimizers as state dicts, the rest as is.

    Every rank calls it; rank 0 writes; all ranks return once the file is complete.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict such as {{'model': model, 'opt': opt}}, got {type(state).__name__}.")
    run = current()
    strategy = run.strategy
    hook = getattr(strategy, "save_checkpoint", None)
    if hook is not None:  # a strategy with its own (sharded) checkpoint format
        hook(path, state)
        return
    converted = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            converted[key] = strategy.module_state(value)
        elif isinstance(value, torch.optim.Optimizer):
            converted[key] = strategy.optimizer_state(value)
        else:
            converted[key] = value
    if run.is_global_zero:
        write_atomically(Path(path), converted)
    barrier()


def write_atomically(path: Path, obj: Any) -> None:
    path = path.absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would stick to the checkpoint; open(..., "xb") honours umask.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read(path: str | os.PathLike[str], weights_only: bool) -> Any:
    if Path(path).is_dir():
        raise CheckpointError(
            f"{path} is a folder: a sharded checkpoint written under strategy='fsdp' or "
            "'deepspeed'. Restore it under the strategy that wrote it with "
            "lite.load(path, {'model': model, ...}), or make one file of it first: "
            f"lite.consolidate_checkpoint({str(path)!r}, 'ckpt.pt') (FSDP) or "
            f"lite.consolidate_deepspeed_checkpoint({str(path)!r}) (DeepSpeed)."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        if weights_only and "weights_only" in str(e):
            raise CheckpointError(
                f"{path} holds objects that weights_only=True refuses to unpickle. If you trust "
                "this file, load it with lite.load(path, state, weights_only=False). torch "
                f"said: {str(e).splitlines()[0]}"
            ) from e
        raise CheckpointError(_incomplete(path, e)) from e
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways, all of them this
        raise CheckpointError(_incomplete(path, e)) from e


def _incomplete(path: str | os.PathLike[str], e: BaseException) -> str:
    return (
        f"{path} is not a complete torch checkpoint (truncated, or not written by torch.save / "
        f"lite.save): {type(e).__name__}: {e}"
    )


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
    hook = getattr(run.strategy, "load_checkpoint", None)
    if hook is not None and state is not None:  # a strategy with its own checkpoint format
        if not weights_only:
            raise ValueError(
                f"lite.load(weights_only=False) is not available under strategy="
                f"{run.strategy.name!r}: the strategy reads its own sharded checkpoint format "
                "and does not take this option. Drop the argument."
            )
        return hook(path, state, strict)  # type: ignore[no-any-return]
    checkpoint = read(path, weights_only)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path} holds a {type(checkpoint).__name__}, not the dict lite.save writes.")
    if state is None:
        return checkpoint
    return restore(run.strategy, path, checkpoint, state, strict)


def restore(
    strategy: Any, path: str | os.PathLike[str], checkpoint: dict[str, Any], state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """Restore ``state`` in place from a loaded single-file ``checkpoint``; return the rest.

    Modules and optimizers go through the strategy (which knows its wrappers and shards);
    other entries of ``state`` are replaced by the checkpoint's values.
    """
    missing = [k for k in state if k not in checkpoint]
    if missing and strict:
        raise KeyError(
            f"{path} has no entry {missing}; it holds {sorted(checkpoint)}. Pass strict=False to "
            "restore only what is there."
        )
    for key, target in state.items():
        if key not in checkpoint:
            continue
        if isinstance(target, torch.nn.Module):
            strategy.load_module_state(target, checkpoint[key], strict)
        elif isinstance(target, torch.optim.Optimizer):
            strategy.load_optimizer_state(target, checkpoint[key])
        else:
            state[key] = checkpoint[key]
    return {k: v for k, v in checkpoint.items() if k not in state}
