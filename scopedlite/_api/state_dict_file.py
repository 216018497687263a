"""A file of ``torch.save(model.state_dict())`` loaded into the one module of ``state``.

``lite.load(path, {"model": model})`` reads the entry ``"model"`` of a checkpoint. A plain
state dict file (the most common checkpoint there is) has no entries, only the module's
keys: it is loaded into the module of ``state`` when ``state`` holds exactly one, under every
strategy (a sharded one reading its part, as from any file). Where that is not what the user
means, or cannot be told, it is refused with the line that loads it:

- ``state`` holds no module (under ``strict=True``): the file has none of its entries;
- ``state`` holds several modules: which one the file is cannot be told;
- ``state`` holds other entries too, under ``strict=True``: the file has none of them;
- none of the file's keys is one of the module's: it is another module's state dict.
"""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._core.dtensors import is_dtensor
from scopedlite._io.canonical import Checkpoint, without_wrapper_prefix
from scopedlite._io.file_format import FileCheckpoint
from scopedlite._io.files import CheckpointError

__all__ = ["as_entries"]


def as_entries(checkpoint: Checkpoint, state: dict[str, Any], strict: bool) -> Checkpoint:
    """``checkpoint`` as ``lite.load`` reads it into ``state``: a plain state dict file as
    the entry of the one module in ``state``; any other checkpoint as it is."""
    if (
        not isinstance(checkpoint, FileCheckpoint)
        or not checkpoint.is_state_dict
        or any(k in checkpoint for k in state)
    ):
        return checkpoint
    keys = list(checkpoint.content)
    _refuse_shards(checkpoint)
    held = f"{checkpoint.path} holds tensors by name only (keys {_few(keys)}), as torch.save(model.state_dict()) writes"
    modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
    if not modules:
        if not strict:  # what is there is returned, as from any file
            return checkpoint
        raise KeyError(
            f"{held}, not the entries {list(state)}. If it is a model's state dict, load it into the model: "
            "lite.load(path, {'model': model})."
        )
    if len(modules) > 1:
        raise ValueError(
            f"{held}, and state holds {len(modules)} modules ({', '.join(map(repr, modules))}): which one it "
            f"belongs to cannot be told. Load it into that one alone, e.g. lite.load(path, {_only(modules[0])})."
        )
    (key,) = modules
    others = [k for k in state if k != key]
    if others and strict:
        raise KeyError(
            f"{held}, and nothing for {others}. Load the model alone: lite.load(path, {_only(key)}), "
            f"or pass strict=False to leave {others} as they are."
        )
    entries = checkpoint.as_entry(key)
    mine = list(state[key].state_dict(keep_vars=True))
    found = without_wrapper_prefix(entries.module(key), lambda: mine).info
    if not set(found) & set(mine):
        raise CheckpointError(
            f"{held}, and none of them is a key of state[{key!r}] ({type(state[key]).__name__}: {_few(mine)}): "
            "it is another module's state dict. Load it into the module it was saved from."
        )
    return entries


def _refuse_shards(checkpoint: FileCheckpoint) -> None:
    """A file of DTensors (``torch.save(model.state_dict())`` of an fsdp or model_parallel
    model) holds the shards of the one rank that saved it: the other ranks' parts of every
    tensor are not in it, so it cannot be loaded as the model's values. Refused, naming the
    two ways to save the whole model (torch's own error was a mixed Tensor/DTensor copy_)."""
    sharded = [k for k, v in checkpoint.content.items() if is_dtensor(v)]
    if sharded:
        raise CheckpointError(
            f"{checkpoint.path} holds DTensors ({_few(sharded)}): torch.save(model.state_dict()) of a model "
            "sharded by fsdp or model_parallel writes only the shard of the rank that saved it, so the "
            "other ranks' parts are not in the file. Save the whole model with "
            "lite.save(path, {'model': model}) on every rank, or gather it on every rank first: "
            "`full = {k: v.full_tensor() for k, v in model.state_dict().items()}`, then torch.save(full, path) "
            "on rank 0."
        )


def _only(key: str) -> str:
    name = key if key.isidentifier() else "model"
    return f"{{{key!r}: {name}}}"


def _few(keys: list[Any]) -> str:
    return repr(keys[:5])[:-1] + (f", ... {len(keys) - 5} more]" if len(keys) > 5 else "]")
