"""A single-file checkpoint (single, ddp, fsdp ``state_dict_type="full"``) in the canonical form.

The file is a dict: a module as its state dict, an optimizer as ``optimizer.state_dict()``
(states keyed by position), anything else as it is. It is memory-mapped, so a rank of a
sharding strategy that reads one slice of each tensor reads only that slice from disk.
The same reader serves the plain entries DeepSpeed keeps in its client state.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from scopedlite._io.canonical import (
    MODULE,
    OBJECT,
    OPTIMIZER,
    Box,
    Checkpoint,
    OptimizerEntry,
    TensorInfo,
    Tensors,
)
from scopedlite._io.files import CheckpointError

__all__ = ["FileCheckpoint", "kind_of"]


def kind_of(value: Any) -> str:
    """What a file's entry looks like: an optimizer's or a module's state dict, or an object."""
    if isinstance(value, Mapping) and {"state", "param_groups"} <= set(value):
        return OPTIMIZER
    if (
        isinstance(value, Mapping)
        and value
        and all(isinstance(k, str) for k in value)
        and any(isinstance(v, torch.Tensor) for v in value.values())
    ):
        return MODULE
    return OBJECT


class FileCheckpoint(Checkpoint):
    """The entries of one file (or of a dict already in memory)."""

    def __init__(self, path: Path, content: dict[str, Any]) -> None:
        super().__init__(path, {key: kind_of(value) for key, value in content.items()})
        self.content = content

    @property
    def is_state_dict(self) -> bool:
        """The file is one module's state dict (``torch.save(model.state_dict())``, the most
        common checkpoint there is) rather than a dict of entries: every value a tensor (or
        a module's extra state)."""
        return bool(self.content) and all(
            isinstance(k, str) and (isinstance(v, torch.Tensor) or k.endswith("_extra_state"))
            for k, v in self.content.items()
        )

    def as_entry(self, key: str) -> FileCheckpoint:
        """This file as a checkpoint whose entry ``key`` is the whole file (a state dict)."""
        return FileCheckpoint(self.path, {key: self.content})

    def object(self, key: str) -> Any:
        return self.content[key]

    def entry(self, key: str) -> Any:
        return self.content[key]

    def module(self, key: str) -> Tensors:
        value = self.content[key]
        if not isinstance(value, Mapping):
            raise CheckpointError(
                f"{self.path}: entry {key!r} holds a {type(value).__name__}, not the state dict of "
                "a module, so it cannot be loaded into the module given under that key."
            )
        return InMemory(
            {k: v for k, v in value.items() if isinstance(v, torch.Tensor)},
            {k: v for k, v in value.items() if not isinstance(v, torch.Tensor)},
        )

    def optimizer(self, key: str) -> OptimizerEntry:
        value = self.content[key]
        if kind_of(value) != OPTIMIZER:
            raise CheckpointError(
                f"{self.path}: entry {key!r} holds a {type(value).__name__}, not an optimizer's "
                "state dict, so it cannot be loaded into the optimizer given under that key."
            )
        return optimizer_entry(value)


def optimizer_entry(state_dict: Mapping[str, Any]) -> OptimizerEntry:
    """``optimizer.state_dict()`` (or one keyed by name) in the canonical form: tensors of a
    parameter's state that are not scalars are read in parts, the rest is kept as is."""
    tensors: dict[Hashable, torch.Tensor] = {}
    state: dict[Any, dict[str, Any]] = {}
    for param, values in state_dict["state"].items():
        state[param] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[(param, name)] = value
                state[param][name] = TensorInfo(value.shape, value.dtype)
            else:
                state[param][name] = value
    groups = [dict(group) for group in state_dict["param_groups"]]
    return OptimizerEntry(groups, state, InMemory(tensors))


class InMemory(Tensors):
    """Tensors already at hand (or memory-mapped): a part is a view, read when it is used."""

    def __init__(self, tensors: Mapping[Hashable, torch.Tensor], extras: dict[str, Any] | None = None) -> None:
        super().__init__({k: TensorInfo(t.shape, t.dtype) for k, t in tensors.items()}, extras)
        self._tensors = tensors

    def read_many(self, parts: Sequence[tuple[Hashable, Box | None]]) -> list[torch.Tensor]:
        out = []
        for key, box in parts:
            self._known(key)
            tensor = self._tensors[key]
            out.append(tensor if box is None else box.of(tensor))
        return out
