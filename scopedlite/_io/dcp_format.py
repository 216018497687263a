"""An FSDP sharded checkpoint folder (``torch.distributed.checkpoint``) in the canonical form.

The folder holds every saving rank's slices of each tensor (``*.distcp``), DCP's
``.metadata`` (where each slice of each tensor lies, and the path of every key in the nested
state) and our ``scopedlite.pt`` (each entry's kind, and the plain entries). Any part of a
tensor is read by planning the reads of exactly the stored slices it overlaps, through
DCP's public planner interface: a rank of any strategy, at any world size, reads what it
holds and nothing more. Each rank reads on its own: no collective is involved.
"""

from __future__ import annotations

import io
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from scopedlite._io.canonical import OBJECT, Box, Checkpoint, OptimizerEntry, TensorInfo, Tensors
from scopedlite._io.files import CheckpointError, read

__all__ = ["META_FILE", "ShardedFolder"]

# Written by rank 0 next to the shards: what each entry is, and the plain (non-tensor) entries.
META_FILE = "scopedlite.pt"


class ShardedFolder(Checkpoint):
    """The entries of a folder ``lite.save`` wrote under ``strategy='fsdp'`` (sharded)."""

    written_by = "fsdp"

    def __init__(self, path: Path, weights_only: bool) -> None:
        from torch.distributed.checkpoint import FileSystemReader  # lazy: loads DCP

        meta = read(path / META_FILE, weights_only=True)
        self.reader = FileSystemReader(str(path))
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)
        self.weights_only = weights_only
        # every stored key's path in the saved state: ("model", "0.weight"), ("opt", "state", ...)
        self.paths: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})
        if not self.paths:
            raise CheckpointError(f"{path}: the shards' metadata does not say which entry each key belongs to.")
        kinds = {key: meta["kinds"].get(key, OBJECT) for key in meta["order"]}
        ranks = {f.name.split("_")[2] for f in path.glob("__*_*.distcp")}  # one file per saving rank
        super().__init__(path, kinds, world_size=max(1, len(ranks)))
        self._objects = meta["objects"]

    def object(self, key: str) -> Any:
        return self._objects[key]

    def _keys(self, entry: str) -> dict[tuple[Any, ...], str]:
        return {p[1:]: fqn for fqn, p in self.paths.items() if p[0] == entry}

    def tensor_info(self, fqn: str) -> TensorInfo | None:
        md = self.metadata.state_dict_metadata[fqn]
        properties = getattr(md, "properties", None)
        return TensorInfo(md.size, properties.dtype) if properties is not None else None

    def module(self, key: str) -> Tensors:
        keys = self._keys(key)
        tensors = {p[0]: fqn for p, fqn in keys.items() if self.tensor_info(fqn) is not None}
        extras = self.read_bytes([fqn for p, fqn in keys.items() if p[0] not in tensors])
        return _Shards(self, tensors, {p[0]: extras[fqn] for p, fqn in keys.items() if p[0] not in tensors})

    def optimizer(self, key: str) -> OptimizerEntry:
        keys = self._keys(key)
        # small values (step counts: 0-d tensors; hyper-parameters: bytes) are read at once
        small = [fqn for p, fqn in keys.items() if (info := self.tensor_info(fqn)) is None or len(info.shape) == 0]
        values = self.read_bytes([f for f in small if self.tensor_info(f) is None])
        scalars = [f for f in small if f not in values]
        values.update(zip(scalars, self.read_parts([(f, None) for f in scalars])))
        state: dict[Any, dict[str, Any]] = {}
        groups: dict[int, dict[str, Any]] = {}
        lazy: dict[Hashable, str] = {}
        for p, fqn in keys.items():
            if p[0] == "state":
                param, name = p[1], p[2]
                if fqn in values:
                    state.setdefault(param, {})[name] = values[fqn]
                else:
                    state.setdefault(param, {})[name] = self.tensor_info(fqn)
                    lazy[(param, name)] = fqn
            elif p[0] == "param_groups":
                groups.setdefault(int(p[1]), {})[p[2]] = values[fqn]
        return OptimizerEntry([groups[i] for i in sorted(groups)], state, _Shards(self, lazy, {}))

    # -- reading --------------------------------------------------------------------------
    def read_bytes(self, fqns: Sequence[str]) -> dict[str, Any]:
        if not fqns:
            return {}
        planner = _PartsPlanner({}, list(fqns), self.weights_only)
        self._run(planner)
        return planner.loaded

    def read_parts(self, parts: Sequence[tuple[str, Box | None]]) -> list[torch.Tensor]:
        """Each ``(key, box)`` read into a new tensor; one pass over the files per distinct key."""
        out: list[torch.Tensor] = []
        pending: dict[str, tuple[Box, torch.Tensor]] = {}
        for fqn, box in parts:
            if fqn in pending:  # the same key twice: read what is planned first
                self._run(_PartsPlanner(pending, [], self.weights_only))
                pending = {}
            info = self.tensor_info(fqn)
            assert info is not None
            box = box or Box((0,) * len(info.shape), tuple(info.shape))
            dest = torch.empty(box.sizes, dtype=info.dtype)
            pending[fqn] = (box, dest)
            out.append(dest)
        if pending:
            self._run(_PartsPlanner(pending, [], self.weights_only))
        return out

    def _run(self, planner: _PartsPlanner) -> None:
        planner.set_up_planner({}, self.metadata, True)
        plan = self.reader.prepare_local_plan(planner.create_local_plan())
        self.reader.read_data(plan, planner).wait()


class _Shards(Tensors):
    def __init__(self, folder: ShardedFolder, fqns: dict[Hashable, str], extras: dict[str, Any]) -> None:
        info = {key: folder.tensor_info(fqn) for key, fqn in fqns.items()}
        super().__init__({k: v for k, v in info.items() if v is not None}, extras)
        self._folder, self._fqns = folder, fqns

    def read_many(self, parts: Sequence[tuple[Hashable, Box | None]]) -> list[torch.Tensor]:
        for key, _ in parts:
            self._known(key)
        return self._folder.read_parts([(self._fqns[key], box) for key, box in parts])


class _PartsPlanner:
    """Plans the reads of given boxes of given keys, and of given byte entries, and takes
    what the storage reader reads (the methods of DCP's ``LoadPlanner`` that ``read_data``
    calls); each box lands in its own tensor."""

    def __init__(self, boxes: dict[str, tuple[Box, torch.Tensor]], byte_keys: list[str], weights_only: bool) -> None:
        self.boxes, self.byte_keys, self.weights_only = boxes, byte_keys, weights_only
        self.loaded: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for fqn, (box, _) in self.boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        for fqn in self.byte_keys:
            zero = torch.Size((0,))
            index = MetadataIndex(fqn)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
        return LoadPlan(items)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=self.weights_only)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        dest = self.boxes[read_item.dest_index.fqn][1]
        return Box(tuple(read_item.dest_offsets), tuple(read_item.lengths)).of(dest)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass
