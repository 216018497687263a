"""Reading pretrained weights in pieces: a Hugging Face ``save_pretrained`` folder or a
``.safetensors`` file, one tensor - or one slice of a tensor - at a time.

safetensors files are memory-mapped and indexable: ``get_slice(name)[start:stop]`` reads only
those rows. A sharded model therefore reads each rank's shard without a full copy of the
tensor (let alone of the model) on any rank.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["PretrainedWeights"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


class PretrainedWeights:
    """The tensors of a ``save_pretrained`` folder (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names) or of one ``.safetensors`` file, by name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from safetensors import safe_open
        except ImportError as error:  # pragma: no cover - installed with transformers
            raise ImportError(
                "Reading pretrained weights needs the safetensors package: pip install safetensors"
            ) from error
        self.path = Path(path)
        self._files = {file: safe_open(str(file), framework="pt", device="cpu") for file in _files_of(self.path)}
        self._where: dict[str, Any] = {}
        for handle in self._files.values():
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict: keys() is all it has
                self._where[name] = handle

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        return self._where[name].get_tensor(name)  # type: ignore[no-any-return]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (along the first dimension) of ``name``, read alone."""
        if not self.shape(name):
            return self.full(name)
        return self._where[name].get_slice(name)[start:stop]  # type: ignore[no-any-return]

    def flat(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements ``start:start+count`` of ``name`` flattened, read from the rows that hold them."""
        shape = self.shape(name)
        if count <= 0:
            return torch.empty(0)
        row = math.prod(shape[1:]) if shape else 1
        first, last = start // row, -(-(start + count) // row)
        block = self.rows(name, first, last).reshape(-1)
        offset = start - first * row
        return block[offset : offset + count]


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(
                f"{path} is not a .safetensors file; pass a save_pretrained folder or a .safetensors file."
            )
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"No pretrained weights at {path}: no such file or folder.")
    if (path / _INDEX).is_file():
        index = json.loads((path / _INDEX).read_text())
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    raise FileNotFoundError(
        f"{path} holds neither {_SINGLE} nor {_INDEX}: not a folder written by save_pretrained "
        "(with safetensors, its default)."
    )
