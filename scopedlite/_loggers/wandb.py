"""``lite.WandbLogger``: metrics to a Weights & Biases run (``scopedlite[wandb]``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["STEP", "WandbLogger"]

STEP = "lite/step"  # the x axis of every metric: lite.log's step, logged as a metric


class WandbLogger:
    """Log every value to one Weights & Biases run per launch block.

    Needs the ``wandb`` package (``pip install scopedlite[wandb]``); it is checked for when
    the logger is built, and imported with the run started on the first write (on global rank
    0 only: the other ranks start no run). ``mode="offline"`` (or ``WANDB_MODE=offline``)
    writes the run to ``save_dir/wandb/offline-run-*`` without an account or a network;
    ``wandb sync`` uploads it later.

    Each value is logged with its ``lite.log`` step as the metric ``lite/step``, which every
    chart uses as its x axis (``define_metric("*", step_metric="lite/step")``), rather than as
    W&B's own step: W&B drops a value whose own step is below one already logged, and steps
    of ``lite.log`` count per name (``loss`` at step 10, then ``val_loss`` at step 2 is fine).

    Args:
        project: The W&B project (None: W&B's default, or ``WANDB_PROJECT``).
        name: The run's display name.
        save_dir: The folder W&B writes under (its ``dir``); created on the first write.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; None for W&B's default
            (``WANDB_MODE``).
        config: Hyperparameters, stored with the run (``wandb.config``).
        **init_kwargs: Passed on to ``wandb.init`` (``entity``, ``tags``, ``group``, ``id``
            with ``resume="allow"`` to continue a run, ``settings``, ...).

    A logger reused by a later launch block starts a new run there (each block's steps count
    from 0 again); ``run_id`` and ``run_dir`` describe the latest.
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        config: Mapping[str, Any] | None = None,
        **init_kwargs: Any,
    ) -> None:
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"WandbLogger(save_dir={save_dir!r}): save_dir must be a str or os.PathLike.")
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"WandbLogger(mode={mode!r}): mode must be 'online', 'offline', 'disabled' or None.")
        if importlib.util.find_spec("wandb") is None:
            raise ImportError(
                "lite.WandbLogger needs the wandb package: pip install 'scopedlite[wandb]' (or "
                "pip install wandb), or log with lite.CSVLogger(path) instead."
            )
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self._init = {"project": project, "name": name, "mode": mode, "config": dict(config or {}), **init_kwargs}
        self._run: Any = None
        self.run_id: str | None = None
        self.run_dir: Path | None = None

    def _open(self) -> Any:
        # wandb takes about a second to import and starts its service process: on rank 0's first write
        import wandb

        if self.save_dir is not None:
            self.save_dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(dir=str(self.save_dir) if self.save_dir is not None else None, **self._init)
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        self.run_id, self.run_dir = run.id, Path(run.dir).parent
        return run

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._run is None:
            self._run = self._open()
        self._run.log({**metrics, STEP: step})

    def finalize(self, status: str) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=0 if status == "success" else 1)

    def __repr__(self) -> str:
        return f"WandbLogger(project={self._init['project']!r})"
