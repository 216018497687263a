"""The one form every checkpoint is read in, whatever wrote it.

A checkpoint on disk is one file (single, ddp, fsdp ``state_dict_type="full"``), a folder of
``torch.distributed.checkpoint`` shards (fsdp) or a DeepSpeed engine folder, written by any
number of ranks. Each format (``file_format``, ``dcp_format``, ``deepspeed_format``) is read
through the same small interface, so a strategy loads any of them with one piece of code:

- a **module** entry is a set of named tensors (the plain module's state dict keys) that are
  read in parts: the whole tensor, or one :class:`Box` of it (a sharded target reads only the
  slice it holds, never the whole model);
- an **optimizer** entry is its param groups (hyper-parameters and parameter names) and, per
  parameter name, its state: tensors shaped like the parameter (moments), read in parts like
  a module's, and small values (the step count) held as they are;
- every other entry is a plain object.

A file keys optimizer states by position, as ``optimizer.state_dict()`` does;
:meth:`OptimizerEntry.by_name` names them after the optimizer they are loaded into.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scopedlite._io.files import CheckpointError

__all__ = [
    "Box",
    "Checkpoint",
    "OptimizerEntry",
    "TensorInfo",
    "Tensors",
    "kinds_of",
    "positional_optimizer_state",
    "read_flat",
    "without_wrapper_prefix",
]

MODULE, OPTIMIZER, OBJECT = "module", "optimizer", "object"


def kinds_of(state: dict[str, Any]) -> dict[str, str]:
    """Each entry's kind, as ``lite.save`` records it next to a sharded checkpoint."""
    return {
        key: MODULE if isinstance(v, torch.nn.Module) else OPTIMIZER if isinstance(v, torch.optim.Optimizer) else OBJECT
        for key, v in state.items()
    }


@dataclass(frozen=True)
class Box:
    """A rectangular part of a tensor: its offsets and sizes in every dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def rows(cls, shape: Sequence[int], start: int, stop: int) -> Box:
        """Rows ``start:stop`` of the first dimension, all of the others."""
        return cls((start, *[0] * (len(shape) - 1)), (stop - start, *shape[1:]))

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (a view)."""
        for dim, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            tensor = tensor.narrow(dim, offset, size)
        return tensor


@dataclass(frozen=True)
class TensorInfo:
    """What a stored tensor is, before any of it is read."""

    shape: torch.Size
    dtype: torch.dtype


class Tensors(ABC):
    """Named tensors of one checkpoint entry, each read whole or in parts.

    Attributes:
        info: Shape and dtype of each tensor, by key.
        extras: The entry's values that are not tensors (a module's ``get_extra_state()``).
    """

    def __init__(self, info: dict[Hashable, TensorInfo], extras: dict[str, Any] | None = None) -> None:
        self.info = info
        self.extras = extras or {}

    def read(self, key: Hashable, box: Box | None = None) -> torch.Tensor:
        """The tensor ``key``, or the part ``box`` of it (a tensor of the box's sizes)."""
        return self.read_many([(key, box)])[0]

    @abstractmethod
    def read_many(self, parts: Sequence[tuple[Hashable, Box | None]]) -> list[torch.Tensor]:
        """Several parts in one go (a format that reads files once per call reads them once)."""

    def _known(self, key: Hashable) -> TensorInfo:
        if key not in self.info:
            raise KeyError(f"the checkpoint holds no tensor {key!r}")
        return self.info[key]


def read_flat(tensors: Tensors, key: Hashable, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of the flattened tensor ``key``, reading only the rows they
    lie in (DeepSpeed keeps parameters as flat ranges; files and shards keep them shaped)."""
    shape = tensors.info[key].shape
    if len(shape) == 0:
        return tensors.read(key).reshape(1)[start:stop]
    per_row = math.prod(shape[1:])
    if per_row == 0 or stop <= start:
        return torch.empty(0, dtype=tensors.info[key].dtype)
    first, last = start // per_row, -(-stop // per_row)
    rows = tensors.read(key, Box.rows(shape, first, last)).reshape(-1)
    return rows[start - first * per_row : stop - first * per_row]


@dataclass
class OptimizerEntry:
    """An optimizer's checkpoint in the canonical form.

    Attributes:
        param_groups: Hyper-parameters per group, and ``"params"``: the parameters' names (or
            positions, for a file written by ``optimizer.state_dict()``).
        state: Per parameter, its state: a :class:`TensorInfo` for each tensor shaped like
            the parameter (read through ``tensors`` under the key ``(parameter, name)``),
            any other value (a step count) as it is.
        tensors: Where those tensors are read.
    """

    param_groups: list[dict[str, Any]]
    state: dict[Any, dict[str, Any]]
    tensors: Tensors

    @property
    def keyed_by_position(self) -> bool:
        return any(isinstance(p, int) for group in self.param_groups for p in group["params"])

    @property
    def names(self) -> list[Any]:
        """The parameters (names or positions) in group order."""
        return [p for group in self.param_groups for p in group["params"]]

    def by_name(self, names: Sequence[str]) -> OptimizerEntry:
        """This entry keyed by parameter name; ``names`` are those of the optimizer it is
        loaded into, in its order (a checkpoint keyed by position is mapped through them)."""
        if not self.keyed_by_position:
            return self
        positions = self.names
        if len(positions) != len(names):
            raise CheckpointError(
                f"The checkpoint's optimizer state covers {len(positions)} parameters, but the "
                f"optimizer it is loaded into holds {len(names)}; build the optimizer over the "
                "same parameters, in the same groups, as the run that saved it."
            )
        rename = {p: names[i] for i, p in enumerate(positions)}
        return OptimizerEntry(
            [{**g, "params": [rename[p] for p in g["params"]]} for g in self.param_groups],
            {rename[p]: values for p, values in self.state.items() if p in rename},
            _Renamed(self.tensors, {(rename[p], k): (p, k) for (p, k) in self.tensors.info if p in rename}),
        )

    def check_groups(self, target: Sequence[Sequence[str]]) -> None:
        """Refuse, naming the difference, when ``target`` (the names of each param group of
        the optimizer loaded into) does not hold the same parameters per group."""
        if len(target) != len(self.param_groups):
            raise CheckpointError(
                f"The checkpoint's optimizer has {len(self.param_groups)} param group(s), the "
                f"optimizer it is loaded into has {len(target)}: build it with the same groups."
            )
        for index, (saved, mine) in enumerate(zip(self.param_groups, target)):
            missing, extra = sorted(set(mine) - set(saved["params"])), sorted(set(saved["params"]) - set(mine))
            if missing or extra:
                raise CheckpointError(
                    f"Param group {index} of the checkpoint's optimizer holds other parameters "
                    f"than the optimizer it is loaded into: not in the checkpoint {missing[:5]}, "
                    f"only in the checkpoint {extra[:5]}."
                )

    def hyperparameters(self, index: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[index].items() if k not in ("params", "param_names")}


class _Renamed(Tensors):
    def __init__(self, inner: Tensors, keys: dict[Hashable, Hashable], extras: dict[str, Any] | None = None) -> None:
        super().__init__({new: inner.info[old] for new, old in keys.items()}, extras)
        self._inner, self._keys = inner, keys

    def read_many(self, parts: Sequence[tuple[Hashable, Box | None]]) -> list[torch.Tensor]:
        return self._inner.read_many([(self._keys[key], box) for key, box in parts])


# What torch's wrappers put before the keys of the module they wrap: DistributedDataParallel
# and DataParallel (``module.``), ``torch.compile`` (``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def without_wrapper_prefix(tensors: Tensors, module_keys: Callable[[], Collection[str]]) -> Tensors:
    """A module entry saved from a wrapped model, its keys without the wrapper's prefix.

    ``torch.save(ddp_model.state_dict())`` in a plain torch script keeps DDP's ``module.``
    before every key, a compiled model's state dict ``_orig_mod.``. As torch's
    ``consume_prefix_in_state_dict_if_present`` does, the prefix is taken off, here only when
    every key has it and none of the keys of the module it loads into (``module_keys``,
    called only then) does: a model whose own submodule is called ``module`` keeps its keys.
    """
    while True:
        keys = [*tensors.info, *tensors.extras]
        prefix = next((p for p in WRAPPER_PREFIXES if keys and all(str(k).startswith(p) for k in keys)), None)
        if prefix is None or any(k.startswith(prefix) for k in module_keys()):
            return tensors
        cut = len(prefix)
        renamed = {str(k)[cut:]: k for k in tensors.info}
        tensors = _Renamed(tensors, renamed, {k[cut:]: v for k, v in tensors.extras.items()})  # type: ignore[arg-type]


def positional_optimizer_state(entry: OptimizerEntry) -> dict[str, Any]:
    """The whole optimizer state in ``optimizer.state_dict()``'s own format (by position),
    every tensor read whole: what a single-file checkpoint holds."""
    index = {name: i for i, name in enumerate(entry.names)}
    state = {}
    for name, values in entry.state.items():
        state[index[name]] = {
            k: entry.tensors.read((name, k)) if isinstance(v, TensorInfo) else v for k, v in values.items()
        }
    groups = [{**g, "params": [index[p] for p in g["params"]]} for g in entry.param_groups]
    return {"state": state, "param_groups": groups}


class Checkpoint(ABC):
    """A checkpoint opened for reading: its entries in the canonical form.

    Attributes:
        path: Where it is.
        kinds: Each entry's kind (``"module"``, ``"optimizer"`` or ``"object"``), in the order
            the state was saved.
        written_by: ``"file"``, ``"fsdp"`` or ``"deepspeed"``.
        world_size: How many ranks wrote it (1 for a file).
    """

    written_by = "file"

    def __init__(self, path: Path, kinds: dict[str, str], world_size: int = 1) -> None:
        self.path = path
        self.kinds = kinds
        self.world_size = world_size

    def __contains__(self, key: str) -> bool:
        return key in self.kinds

    def __enter__(self) -> Checkpoint:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - a format holding more than mapped files frees it here
        """Let go of what was opened. Memory-mapped files go with the last tensor read from
        them (a value handed to the caller keeps its own mapping alive)."""

    @abstractmethod
    def object(self, key: str) -> Any: ...

    @abstractmethod
    def module(self, key: str) -> Tensors: ...

    @abstractmethod
    def optimizer(self, key: str) -> OptimizerEntry: ...

    def entry(self, key: str) -> Any:
        """Entry ``key`` as a single-file checkpoint holds it (tensors read whole)."""
        kind = self.kinds[key]
        if kind == MODULE:
            tensors = self.module(key)
            return {**dict(zip(tensors.info, tensors.read_many([(k, None) for k in tensors.info]))), **tensors.extras}
        if kind == OPTIMIZER:
            return positional_optimizer_state(self.optimizer(key))
        return self.object(key)

    def whole(self) -> dict[str, Any]:
        """Every entry as one file holds it: what ``lite.load(path)`` returns and what
        ``lite.consolidate_checkpoint`` writes. Needs memory for the whole model."""
        return {key: self.entry(key) for key in self.kinds}

    def objects(self) -> Iterator[str]:
        return (k for k, kind in self.kinds.items() if kind == OBJECT)
