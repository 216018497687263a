"""``lite.consolidate_checkpoint``: one file from a checkpoint folder (FSDP's or DeepSpeed's).

``lite.load`` reads a folder under any strategy and world size, so no run needs this; it is
for those who want one file: to hand a model on, to read it with plain ``torch.load``.
Optimizer states are written by position (``optimizer.state_dict()``'s own format), so the
file loads into a plain optimizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scopedlite._io.files import CheckpointError, write_atomically
from scopedlite._io.reader import open_checkpoint

__all__ = ["consolidate_checkpoint", "optimizer_state_to_indices"]


def consolidate_checkpoint(src_folder: str | os.PathLike[str], dst_file: str | os.PathLike[str]) -> None:
    """Turn the folder ``lite.save`` wrote under ``strategy='fsdp'`` (sharded) or
    ``strategy='deepspeed'`` into the single file the other strategies write.

    Runs in one process, outside any launch; needs memory for the whole model.

    Args:
        src_folder: The checkpoint folder.
        dst_file: Where to write the consolidated checkpoint (written atomically).
    """
    src = Path(src_folder)
    if not src.is_dir():
        raise CheckpointError(
            f"src_folder={str(src_folder)!r} is not a checkpoint folder; a single-file "
            "checkpoint needs no consolidation."
        )
    with open_checkpoint(src) as checkpoint:
        write_atomically(Path(dst_file).absolute(), checkpoint.whole())


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
