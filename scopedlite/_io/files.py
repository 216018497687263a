"""Checkpoint files: written atomically, read safely.

Below the strategies: the single-file format every strategy can write, and the atomic swap of
a checkpoint folder, so the strategies with formats of their own (FSDP's shards, DeepSpeed's
engine directory) share the same guarantees. Reading any format: ``reader.open_checkpoint``.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = [
    "CheckpointError",
    "WriteAbandoned",
    "read",
    "save_unmasked",
    "state_dicts",
    "swap_folder_into_place",
    "write_atomically",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be read (truncated, not a torch checkpoint, or unsafe), or one
    written in the background (``lite.save(..., blocking=False)``) could not be written."""


class WriteAbandoned(Exception):
    """A write in the background was asked to stop (Ctrl-C while waiting for it): raised in
    the writing thread at its next write, so that the temporary file is removed."""


def state_dicts(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its modules and optimizers replaced by their full state dicts, as the
    strategy gives them (under a sharding strategy a collective: every rank takes part)."""
    converted: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            converted[key] = strategy.module_state(value)
        elif isinstance(value, torch.optim.Optimizer):
            converted[key] = strategy.optimizer_state(value)
        else:
            converted[key] = value
    return converted


def write_atomically(path: Path, obj: Any, stop: threading.Event | None = None) -> None:
    """``torch.save(obj)`` to a temporary file beside ``path``, synced and renamed over it.

    ``stop``: set by another thread to abandon the write (see :class:`WriteAbandoned`); the
    temporary file is removed and ``path`` keeps what it held.
    """
    path = path.absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would stick to the checkpoint; open(..., "xb") honours umask.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:
            save_unmasked(obj, f, stop)
            f.flush()
            os.fsync(f.fileno())
        if stop is not None and stop.is_set():
            raise WriteAbandoned(f"the write of {path} was abandoned")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def save_unmasked(obj: Any, file: BinaryIO, stop: threading.Event | None = None) -> None:
    """``torch.save(obj, file)``, raising what went wrong rather than what it caused.

    When a write to ``file`` raises (Ctrl-C arriving in the middle of a large write, a full
    disk), torch's zip writer is left in the middle of a record, and the end-of-file step its
    ``with`` block runs on the way out raises ``RuntimeError: [enforce fail at
    inline_container.cc] ... unexpected pos``, which is all the user would see. The first
    exception of a write is raised instead (a KeyboardInterrupt stays one). ``stop``: once
    set, the next write raises :class:`WriteAbandoned`.
    """
    writes = _Writes(file, stop)
    try:
        torch.save(obj, writes)
    except Exception as e:
        # An interrupt can also arrive as our write is entered, before it records anything.
        cause = writes.error or (e.__context__ if isinstance(e.__context__, KeyboardInterrupt) else None)
        if cause is None or cause is e:
            raise
        raise cause from None


class _Writes:
    """The file ``torch.save`` writes to, remembering the first exception a write raised."""

    def __init__(self, file: BinaryIO, stop: threading.Event | None = None) -> None:
        self.file = file
        self.stop = stop
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            if self.stop is not None and self.stop.is_set():
                raise WriteAbandoned(f"the write of {getattr(self.file, 'name', 'a checkpoint')} was abandoned")
            return self.file.write(data)
        except BaseException as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.file.flush()


def read(path: str | os.PathLike[str], weights_only: bool, mmap: bool = False) -> Any:
    """``torch.load`` to the CPU, every failure a :class:`CheckpointError` that says why.

    ``mmap=True`` maps the file instead of reading it: a tensor's bytes are read only when
    used, so a rank that needs a slice of a large checkpoint reads that slice.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        if weights_only and "weights_only" in str(e):
            raise CheckpointError(
                f"{path} holds objects that weights_only=True refuses to unpickle. If you trust "
                "this file, load it with lite.load(path, state, weights_only=False). torch "
                f"said: {str(e).splitlines()[0]}"
            ) from e
        raise CheckpointError(_incomplete(path, e)) from e
    except RuntimeError as e:
        if mmap and "mmap" in str(e):  # written by torch.save's legacy (non-zip) format
            return read(path, weights_only)
        raise CheckpointError(_incomplete(path, e)) from e
    except Exception as e:  # a damaged file fails in many ways, all of them this
        raise CheckpointError(_incomplete(path, e)) from e


def _incomplete(path: str | os.PathLike[str], e: BaseException) -> str:
    return (
        f"{path} is not a complete torch checkpoint (truncated, or not written by torch.save / "
        f"lite.save): {type(e).__name__}: {e}"
    )


def swap_folder_into_place(staging: Path, path: Path, token: str) -> None:
    """Rename the complete folder ``staging`` to ``path``, replacing what was there.

    The previous checkpoint (folder, file or link) is renamed aside first and removed only
    after the new one is in place, so a crash leaves one complete checkpoint at ``path`` or
    beside it, never a mix of both.
    """
    old = path.parent / f".{path.name}.{token}.old"
    if path.exists() or path.is_symlink():
        os.rename(path, old)
    os.rename(staging, path)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    elif old.exists() or old.is_symlink():
        old.unlink()
