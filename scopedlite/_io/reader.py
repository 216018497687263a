"""``open_checkpoint``: any checkpoint ``lite.save`` writes, opened in the canonical form.

What is on disk decides, never the strategy of the run that reads it: a file is a single-file
checkpoint; a folder with ``scopedlite.pt`` holds FSDP's shards; a folder with DeepSpeed's
``checkpoint/`` is a DeepSpeed engine's.
"""

from __future__ import annotations

import os
from pathlib import Path

from scopedlite._io.canonical import Checkpoint
from scopedlite._io.dcp_format import META_FILE, ShardedFolder
from scopedlite._io.deepspeed_format import DeepSpeedFolder
from scopedlite._io.file_format import FileCheckpoint
from scopedlite._io.files import CheckpointError, read

__all__ = ["open_checkpoint"]


def open_checkpoint(path: str | os.PathLike[str], weights_only: bool = True) -> Checkpoint:
    """Open the checkpoint at ``path`` for reading (use it in a ``with`` block).

    Args:
        path: A file or folder written by ``lite.save`` under any strategy.
        weights_only: Unpickle nothing but tensors and plain containers (and, in a
            DeepSpeed folder, stand-ins for DeepSpeed's own bookkeeping classes).
    """
    path = Path(path)
    if path.is_dir():
        if (path / META_FILE).is_file():
            return ShardedFolder(path, weights_only)
        return DeepSpeedFolder(path, weights_only)
    content = read(path, weights_only, mmap=True)
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds a {type(content).__name__}, not the dict lite.save writes.")
    return FileCheckpoint(path, content)
