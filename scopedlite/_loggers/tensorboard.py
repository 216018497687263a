"""``lite.TensorBoardLogger``: scalars in TensorBoard event files (``scopedlite[tensorboard]``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger:
    """Write every logged value as a TensorBoard scalar (``add_scalar(name, value, step)``).

    Needs the ``tensorboard`` package (``pip install scopedlite[tensorboard]``); it is checked
    for when the logger is built, so a missing package fails before training starts, and
    imported on the first write (on global rank 0 only). Writes through
    ``torch.utils.tensorboard.SummaryWriter``; ``tensorboard --logdir LOG_DIR`` shows them.

    Args:
        log_dir: The folder for the event files; created on the first write.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"TensorBoardLogger(log_dir={log_dir!r}): log_dir must be a str or os.PathLike.")
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "lite.TensorBoardLogger needs the tensorboard package: pip install "
                "'scopedlite[tensorboard]' (or pip install tensorboard), or log with "
                "lite.CSVLogger(path) instead."
            )
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            # needs the tensorboard package, and takes a second: imported on rank 0's first write
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger({str(self.log_dir)!r})"
