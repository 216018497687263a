"""A DeepSpeed checkpoint folder (``lite.save`` under ``strategy='deepspeed'``) in the canonical
form, read without DeepSpeed.

The engine writes, under ``<path>/checkpoint/``, a model-states file (the module's buffers
and, up to ZeRO-2, its low-precision parameters; our own entries travel in it as DeepSpeed's
client state) and one optimizer-states file per rank: that rank's flat partitions of the fp32
master parameters and of the optimizer's moments. A parameter is found in them as follows:

- ZeRO-1/2: one flat partition per param group; ``param_slice_mappings`` gives, per rank,
  where its fragment of each parameter lies (the fragments follow each other rank by rank);
- ZeRO-3: one flat partition per sub-group; every parameter takes ``ceil(numel / world)``
  elements on every rank, in the order of ``param_shapes`` (the last rank's part padded).

Any part of a parameter, of its fp32 value or of one of its moments, is read from the ranks'
files that hold it, each memory-mapped for the one call that reads it: a rank loading the
checkpoint at another world size, or under another strategy, reads what it holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scopedlite._io.canonical import Box, Checkpoint, OptimizerEntry, TensorInfo, Tensors
from scopedlite._io.file_format import FileCheckpoint, InMemory, optimizer_entry
from scopedlite._io.files import CheckpointError, read
from scopedlite._private.deepspeed_internals import pickled_classes_readable

__all__ = ["CLIENT_KEY", "DeepSpeedFolder", "TAG", "client_state"]

# The tag (sub-folder) the engine writes; fixed so a checkpoint is one self-contained folder.
TAG = "checkpoint"
# The key of DeepSpeed's client state under which our entries travel.
CLIENT_KEY = "scopedlite"
_FORMAT = 2
# DeepSpeed prefixes the optimizer files with "bf16_" when the run used bf16.
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def client_state(
    order: list[str], kinds: dict[str, str], engine: str, optimizer: str | None, entries: dict[str, Any]
) -> dict[str, Any]:
    """What ``lite.save`` hands the engine as client state: the entries that are not the
    engine and its optimizer, and which keys those two were."""
    return {
        "format": _FORMAT,
        "order": order,
        "kinds": kinds,
        "engine": engine,
        "optimizer": optimizer,
        "entries": entries,
    }


@dataclass(frozen=True)
class _Piece:
    """Elements ``start:start+numel`` of a parameter, at ``offset`` in flat group ``group``
    of rank ``rank``'s optimizer file."""

    rank: int
    group: int
    offset: int
    start: int
    numel: int


class DeepSpeedFolder(Checkpoint):
    """The entries of a folder ``lite.save`` wrote under ``strategy='deepspeed'``."""

    written_by = "deepspeed"

    def __init__(self, path: Path, weights_only: bool) -> None:
        self.path = path  # set again by Checkpoint.__init__; the messages below need it first
        self.folder = path / TAG
        if not self.folder.is_dir():
            raise CheckpointError(
                f"{path} is a folder but not a checkpoint written by lite.save (no {TAG}/ "
                "folder of DeepSpeed's, nor the scopedlite.pt of a sharded FSDP checkpoint)."
            )
        self.weights_only = weights_only
        stage3 = self.folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3: one per rank
        self.model = self.load_file(stage3 if stage3.is_file() else self.folder / "mp_rank_00_model_states.pt")
        config = self.model.get("ds_config") or {}
        self.stage = int((config.get("zero_optimization") or {}).get("stage", 0))
        world_size = int(self.model.get("dp_world_size", 1))
        self.optim_files = self._optimizer_files(world_size) if self.stage > 0 else []
        client = self.model.get(CLIENT_KEY) or {}
        if client.get("format") == _FORMAT:
            self.engine_key: str | None = client["engine"]
            self.optimizer_key: str | None = client["optimizer"]
            self.entries = FileCheckpoint(path, client["entries"])
            kinds = {key: client["kinds"][key] for key in client["order"]}
        else:  # written before the format recorded which keys the engine and optimizer were
            self.engine_key = self.optimizer_key = None
            self.entries = FileCheckpoint(path, client)
            kinds = dict(self.entries.kinds)
        super().__init__(path, kinds, world_size)
        self._layout: dict[str, list[_Piece]] | None = None

    # -- files ------------------------------------------------------------------------------
    def load_file(self, file: Path) -> dict[str, Any]:
        if not file.is_file():
            raise CheckpointError(f"{self.path}: DeepSpeed's {file.name} is missing; the checkpoint is incomplete.")
        with pickled_classes_readable():
            return read(file, self.weights_only, mmap=True)

    def _optimizer_files(self, world_size: int) -> list[Path]:
        found = {}
        for file in self.folder.iterdir():
            match = _OPTIM_FILE.fullmatch(file.name)
            if match:
                if int(match.group(2)) != 0:
                    raise CheckpointError(
                        f"{self.path} was written with model (tensor) parallelism, which lite.load cannot reshape."
                    )
                found[int(match.group(1))] = file
        if sorted(found) != list(range(world_size)):
            raise CheckpointError(
                f"{self.path}: DeepSpeed's optimizer files of ranks {sorted(found)} are there, "
                f"but {world_size} ranks wrote the checkpoint; it is incomplete."
            )
        return [found[r] for r in range(world_size)]

    @contextmanager
    def opened_ranks(self) -> Iterator[dict[int, Any]]:
        """The optimizer files' contents, each opened (memory-mapped) when first asked for and
        let go of when the block ends: what one read touches is all that stays mapped."""

        class Lazy(dict):  # type: ignore[type-arg]
            def __missing__(inner, rank: int) -> Any:
                inner[rank] = self.load_file(self.optim_files[rank])["optimizer_state_dict"]
                return inner[rank]

        lazy = Lazy()
        try:
            yield lazy
        finally:
            lazy.clear()

    def flat_key(self) -> str:
        return "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"

    def inner_state(self, rank: dict[str, Any]) -> dict[str, Any]:
        return rank["optimizer_state_dict"] if self.stage == 3 else rank["base_optimizer_state"]

    def groups(self) -> list[dict[str, torch.Size]]:
        """The trainable parameters' shapes per flat group, in order."""
        return list(self.model["param_shapes"])

    def layout(self) -> dict[str, list[_Piece]]:
        """Where the pieces of each trainable parameter lie, rank by rank."""
        if self._layout is not None:
            return self._layout
        world, layout = self.world_size, {}
        if self.stage == 3:
            for group, shapes in enumerate(self.groups()):
                offset = 0
                for name, shape in shapes.items():
                    numel, size = math.prod(shape), -(-math.prod(shape) // world)
                    layout[name] = [
                        _Piece(r, group, offset, r * size, max(0, min(size, numel - r * size))) for r in range(world)
                    ]
                    offset += size
        else:
            with self.opened_ranks() as ranks:
                for r in range(world):
                    for group, mapping in enumerate(ranks[r]["param_slice_mappings"]):
                        for name, address in mapping.items():
                            pieces = layout.setdefault(name, [])
                            start = sum(p.numel for p in pieces)
                            numel, offset = int(address.field("numel")), int(address.field("start"))
                            pieces.append(_Piece(r, group, offset, start, numel))
        for shapes in self.groups():
            for name, shape in shapes.items():
                if sum(p.numel for p in layout.get(name, [])) != math.prod(shape):
                    raise CheckpointError(
                        f"{self.path}: DeepSpeed's optimizer files do not hold all of parameter "
                        f"{name!r} (ZeRO stage {self.stage}, {world} ranks); the layout is not one "
                        "lite.load knows (DeepSpeed 0.19)."
                    )
        self._layout = layout
        return layout

    # -- entries ----------------------------------------------------------------------------
    def object(self, key: str) -> Any:
        return self.entries.object(key)

    def module(self, key: str) -> Tensors:
        if key != self.engine_key:
            return self.entries.module(key)
        return self.engine_module()

    def engine_module(self) -> Tensors:
        """The engine's model: its trainable parameters' fp32 values, its frozen parameters
        and buffers."""
        module = self.model["module"]
        if self.stage == 0:
            return InMemory(module)
        return _EngineTensors(self, module)

    def optimizer(self, key: str) -> OptimizerEntry:
        if key != self.optimizer_key:
            return self.entries.optimizer(key)
        if self.stage == 0:
            return optimizer_entry(self.model["optimizer"])
        with self.opened_ranks() as ranks:
            inner = self.inner_state(ranks[0])
            state_of_group = {int(k): dict(v) for k, v in inner["state"].items()}
            flats = ranks[0][self.flat_key()]
            shapes = self.groups()
            groups, state = [], {}
            for saved in inner["param_groups"]:
                names = [name for i in saved["params"] for name in shapes[i]]
                groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": names})
                for i in saved["params"]:
                    for name, shape in shapes[i].items():
                        values = state_of_group.get(i)
                        if values:
                            state[name] = {
                                k: TensorInfo(torch.Size(shape), v.dtype)
                                if isinstance(v, torch.Tensor) and v.shape == flats[i].shape
                                else (v.clone() if isinstance(v, torch.Tensor) else v)
                                for k, v in values.items()
                            }
        tensor_keys = {(n, k) for n, values in state.items() for k, v in values.items() if isinstance(v, TensorInfo)}
        return OptimizerEntry(groups, state, _StateTensors(self, {k: state[k[0]][k[1]] for k in tensor_keys}))

    def whole(self) -> dict[str, Any]:
        if self.engine_key is None:
            raise CheckpointError(
                f"{self.path} was written by an earlier scopedlite, which did not record the "
                "keys of the model and its optimizer: load it under strategy='deepspeed' at the "
                "world size that wrote it, or read the model with "
                f"lite.consolidate_deepspeed_checkpoint({str(self.path)!r})."
            )
        return super().whole()

    # -- reading ------------------------------------------------------------------------------
    def read_pieces(self, parts: Sequence[tuple[str, str, int, int]]) -> list[torch.Tensor]:
        """For each ``(parameter, what, start, stop)``: elements ``start:stop`` of the
        flattened parameter's fp32 value (``what="fp32"``) or of one of its moments."""
        layout = self.layout()
        out = []
        with self.opened_ranks() as ranks:
            for name, what, start, stop in parts:
                chunks = []
                for piece in layout[name]:
                    lo, hi = max(start, piece.start), min(stop, piece.start + piece.numel)
                    if lo >= hi:
                        continue
                    rank = ranks[piece.rank]
                    if what == "fp32":
                        flat = rank[self.flat_key()][piece.group]
                    else:
                        state = self.inner_state(rank)["state"]
                        flat = state[piece.group][what]
                    chunks.append(flat[piece.offset + lo - piece.start : piece.offset + hi - piece.start].clone())
                out.append(torch.cat(chunks) if chunks else torch.empty(0))
        return out


class _EngineTensors(Tensors):
    """The engine module's state dict: trainable parameters from the optimizer files (fp32),
    frozen parameters from the model-states files' fragments, buffers as saved."""

    def __init__(self, folder: DeepSpeedFolder, module: dict[str, Any]) -> None:
        self.folder = folder
        trainable = {name: torch.Size(shape) for shapes in folder.groups() for name, shape in shapes.items()}
        self.frozen = {
            name: torch.Size(shape) for name, shape in (folder.model.get("frozen_param_shapes") or {}).items()
        }
        self.aliases = dict(folder.model.get("shared_params") or {})
        self.saved = module
        info: dict[Hashable, TensorInfo] = {}
        for key in module:
            source = self.aliases.get(key, key)
            if source in trainable:
                info[key] = TensorInfo(trainable[source], torch.float32)
            elif source in self.frozen:
                info[key] = TensorInfo(self.frozen[source], _frozen_dtype(folder, source))
            elif isinstance(module[key], torch.Tensor):
                info[key] = TensorInfo(module[key].shape, module[key].dtype)
        super().__init__(info, {k: v for k, v in module.items() if not isinstance(v, torch.Tensor)})
        self.trainable = trainable

    def read_many(self, parts: Sequence[tuple[Hashable, Box | None]]) -> list[torch.Tensor]:
        out = []
        for key, box in parts:
            info = self._known(key)
            source = self.aliases.get(str(key), str(key))
            if source in self.trainable:
                out.append(
                    _boxed(lambda a, b, source=source: self.folder.read_pieces([(source, "fp32", a, b)])[0], info, box)
                )
            elif source in self.frozen:
                out.append(_boxed(lambda a, b, source=source: _frozen(self.folder, source, a, b), info, box))
            else:
                tensor = self.saved[key]
                out.append(tensor if box is None else box.of(tensor))
        return out


class _StateTensors(Tensors):
    def __init__(self, folder: DeepSpeedFolder, info: dict[Hashable, TensorInfo]) -> None:
        super().__init__(info)
        self.folder = folder

    def read_many(self, parts: Sequence[tuple[Hashable, Box | None]]) -> list[torch.Tensor]:
        out = []
        for key, box in parts:
            info = self._known(key)
            name, what = key  # type: ignore[misc]
            out.append(
                _boxed(lambda a, b, name=name, what=what: self.folder.read_pieces([(name, what, a, b)])[0], info, box)
            )
        return out


def _boxed(read_range: Any, info: TensorInfo, box: Box | None) -> torch.Tensor:
    """Part ``box`` of a tensor stored flat, read as the range of elements that covers it."""
    shape = info.shape
    if box is None:
        return read_range(0, math.prod(shape)).view(shape)
    if math.prod(box.sizes) == 0:
        return torch.empty(box.sizes, dtype=info.dtype)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    first = sum(o * s for o, s in zip(box.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.sizes, strides)) + 1
    covering = read_range(first, last)
    # the box inside the covering range: strides of the whole tensor, from its first element
    return covering.as_strided(box.sizes, strides, 0).clone()


def _frozen_dtype(folder: DeepSpeedFolder, name: str) -> torch.dtype:
    fragment = (folder.model.get("frozen_param_fragments") or {}).get(name)
    return fragment.dtype if isinstance(fragment, torch.Tensor) else torch.float32


def _frozen(folder: DeepSpeedFolder, name: str, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of a frozen parameter: whole in the model-states file up to
    ZeRO-2, one ``ceil(numel / world)`` fragment per rank's model-states file under ZeRO-3."""
    if folder.stage < 3:
        return folder.model["frozen_param_fragments"][name].reshape(-1)[start:stop].clone()
    numel = math.prod(folder.model["frozen_param_shapes"][name])
    size = -(-numel // folder.world_size)
    chunks = []
    for rank in range(start // size, -(-stop // size) if stop > start else 0):
        file = folder.folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        fragment = folder.load_file(file)["frozen_param_fragments"][name].reshape(-1)
        lo, hi = max(start, rank * size), min(stop, (rank + 1) * size, numel)
        chunks.append(fragment[lo - rank * size : hi - rank * size].clone())
    return torch.cat(chunks) if chunks else torch.empty(0)
