"""``lite.consolidate_checkpoint``: one file from a sharded (folder) checkpoint.

A sharded checkpoint is written by every rank of an FSDP run, each its own slice, and can be
read back by any number of FSDP ranks. To use it in one process - evaluation, export, a run
with another strategy - gather it into the single file ``lite.load`` reads anywhere.
Optimizer states are stored by parameter name in the folder and by position in the file
(``optimizer.state_dict()``'s own format), so the file loads into a plain optimizer.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch

from scopedlite._io.files import CheckpointError, read, write_atomically

__all__ = [
    "META_FILE",
    "consolidate_checkpoint",
    "optimizer_state_to_indices",
    "optimizer_state_to_names",
]

# Written by rank 0 next to the shards: what each entry is, and the plain (non-tensor) entries.
META_FILE = "scopedlite.pt"


def consolidate_checkpoint(src_folder: str | os.PathLike[str], dst_file: str | os.PathLike[str]) -> None:
    """Turn the folder ``lite.save`` wrote under ``FSDPStrategy(state_dict_type="sharded")``
    into one file that ``lite.load`` reads in a single process (or under any strategy).

    Runs in one process, outside any launch; needs memory for the whole model.

    Args:
        src_folder: The sharded checkpoint folder.
        dst_file: Where to write the consolidated checkpoint (written atomically).
    """
    from torch.distributed.checkpoint.format_utils import (
        dcp_to_torch_save,  # lazy: loads DCP
    )

    src = Path(src_folder)
    if not (src / META_FILE).is_file():
        raise CheckpointError(
            f"src_folder={str(src_folder)!r} is not a sharded checkpoint written by lite.save "
            f"(no {META_FILE} in it). A single-file checkpoint needs no consolidation."
        )
    meta = read(src / META_FILE, weights_only=True)
    dst = Path(dst_file).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    gathered = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.gather"
    try:
        dcp_to_torch_save(src, gathered)
        tensors = torch.load(gathered, map_location="cpu", weights_only=True)
    finally:
        gathered.unlink(missing_ok=True)
    out: dict[str, Any] = {}
    for key in meta["order"]:
        kind = meta["kinds"].get(key)
        if kind == "module":
            out[key] = tensors[key]
        elif kind == "optimizer":
            out[key] = optimizer_state_to_indices(tensors[key])
        else:
            out[key] = meta["objects"][key]
    write_atomically(dst, out)


def optimizer_state_to_indices(state: dict[str, Any]) -> dict[str, Any]:
    """Key an optimizer state by position (``optimizer.state_dict()``) instead of by name."""
    groups = state["param_groups"]
    names = [name for group in groups for name in group["params"]]
    if all(isinstance(n, int) for n in names):
        return state
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in groups],
    }


def optimizer_state_to_names(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Key an optimizer state by parameter name; ``names`` lists them in the optimizer's order."""
    groups = state["param_groups"]
    positions = [p for group in groups for p in group["params"]]
    if not all(isinstance(p, int) for p in positions):
        return state
    if len(positions) != len(names):
        raise ValueError(
            f"The checkpoint's optimizer state covers {len(positions)} parameters, but the "
            f"optimizer holds {len(names)}; they must be built the same way."
        )
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[p] for p in group["params"]]} for group in groups],
    }
