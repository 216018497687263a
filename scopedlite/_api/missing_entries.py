"""What ``lite.load`` says when ``state`` asks for entries the checkpoint does not have.

Plain torch scripts name their entries as they like; PyTorch's own tutorial saves
``{"epoch": ..., "model_state_dict": ..., "optimizer_state_dict": ..., "loss": ...}``.
Loading that into ``{"model": model, "optimizer": opt}`` finds neither key, and
``strict=False`` would restore nothing of the model: a fix that does nothing. So where the
checkpoint has exactly one unclaimed entry of the kind a missing module or optimizer needs,
the error shows the line that loads it under the checkpoint's own names.
"""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._io.canonical import MODULE, OPTIMIZER, Checkpoint

__all__ = ["missing_entries"]


def missing_entries(checkpoint: Checkpoint, state: dict[str, Any], missing: list[str]) -> str:
    """The ``KeyError`` message for the keys of ``state`` in ``missing``."""
    held = f"{checkpoint.path} has no entry {missing}; it holds {list(checkpoint.kinds)}."
    unclaimed = [k for k in checkpoint.kinds if k not in state]
    renamed: dict[str, str] = {}
    for key in missing:
        kind = _kind(state[key])
        candidates = [k for k in unclaimed if checkpoint.kinds[k] == kind] if kind else []
        if len(candidates) == 1 and candidates[0] not in renamed.values():
            renamed[key] = candidates[0]
    if not renamed:
        return f"{held} Pass strict=False to restore the entries both have and leave {missing} as they are."
    line = ", ".join(f"{renamed.get(k, k)!r}: {_name(k)}" for k in state if k not in missing or k in renamed)
    left = [k for k in missing if k not in renamed]
    also = f" ({left} left out: the checkpoint has nothing for them)" if left else ""
    return f"{held} Load them under the checkpoint's names: lite.load(path, {{{line}}}){also}."


def _kind(value: Any) -> str | None:
    if isinstance(value, torch.nn.Module):
        return MODULE
    if isinstance(value, torch.optim.Optimizer):
        return OPTIMIZER
    return None


def _name(key: str) -> str:
    return key if key.isidentifier() else f"state[{key!r}]"
