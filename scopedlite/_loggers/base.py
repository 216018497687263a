"""The logger protocol and :class:`MetricLog`, one run's record of what was logged.

A logger is any object with two methods (:class:`Logger`); ``launch(loggers=[...])`` takes a
list of them. Each run keeps one :class:`MetricLog`: it checks every ``lite.log`` call on every
rank (so a mistake fails the same way everywhere, not only where it is written), keeps the
steps of each name increasing, and hands the values to the loggers on global rank 0 alone, so
a value is written once however many processes run. The launch scope finishes it when the
block ends, successfully or not, so what was logged before a failure is on disk.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Logger", "MetricLog", "check_loggers"]


@runtime_checkable
class Logger(Protocol):
    """What ``launch(loggers=[...])`` accepts: two methods, called on global rank 0 only.

    Write your own for any tracker (Neptune, Comet, a database, ...) by defining them; no base
    class is needed. ``lite.WandbLogger`` and ``lite.MLFlowLogger`` are two such classes.
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> Python float) at ``step``."""

    def finalize(self, status: str) -> None:
        """Flush and close; ``status`` is ``"success"`` or ``"failed"``. A later
        ``log_metrics`` (the logger reused by another launch block) must reopen."""


def check_loggers(loggers: object) -> tuple[Logger, ...]:
    """Validate ``launch(loggers=...)``: None, one logger, or a list/tuple of them."""
    if loggers is None:
        return ()
    items = list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
    for i, logger in enumerate(items):
        if not isinstance(logger, Logger):
            raise TypeError(
                f"loggers[{i}]={logger!r} is not a logger: it needs the methods "
                "log_metrics(metrics, step) and finalize(status) (see lite.Logger). Use "
                "lite.CSVLogger(path), lite.TensorBoardLogger(log_dir), lite.WandbLogger(...), "
                "lite.MLFlowLogger(...) or a class of your own."
            )
    return tuple(items)


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"lite.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}: log one "
                "number, e.g. loss.item() or lite.all_reduce(x, op='mean') of a scalar."
            )
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"lite.log({name!r}, {value!r}): the value must be a Python number or a one-element "
            f"tensor, got {type(value).__name__}."
        )
    return float(value)


class MetricLog:
    """One run's metrics: checked on every rank, written by global rank 0.

    Args:
        loggers: The run's loggers (``launch(loggers=...)``).
        write: Whether this process writes (global rank 0).
    """

    def __init__(self, loggers: Sequence[Logger], write: bool) -> None:
        self.loggers = tuple(loggers)
        self.write = write and bool(self.loggers)
        self._last_step: dict[str, int] = {}

    def record(self, metrics: Mapping[str, Any], step: int | None) -> None:
        """Check and write ``metrics`` at ``step``; ``None``: each name's next step.

        Raises:
            TypeError, ValueError: A name that is not a non-empty string, a value that is not
                one number, or a step that is not after the name's last one.
        """
        if not isinstance(metrics, Mapping):
            raise TypeError(f"lite.log_dict takes a mapping of name -> number, got {type(metrics).__name__}.")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step={step!r} is not valid: it must be an int >= 0, or None for the next step.")
        values: dict[str, float] = {}
        steps: dict[str, int] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"metric names must be non-empty strings, got {name!r}.")
            last = self._last_step.get(name)
            at = step if step is not None else (0 if last is None else last + 1)
            if last is not None and at <= last:
                raise ValueError(
                    f"step={at} for {name!r} is not after its last step {last}: steps of a "
                    f"name must increase. Pass step={last + 1} or more, or step=None for the next."
                )
            values[name] = _number(name, value)
            steps[name] = at
        self._last_step.update(steps)
        if not self.write or not values:
            return
        # Names logged together at one explicit step share it; with step=None each name
        # counts its own, so they are handed over one step at a time.
        by_step: dict[int, dict[str, float]] = {}
        for name, value in values.items():
            by_step.setdefault(steps[name], {})[name] = value
        for at, group in by_step.items():
            for logger in self.loggers:
                logger.log_metrics(group, at)

    def last_step(self, name: str) -> int | None:
        """The last step ``name`` was logged at (checked on every rank alike), or None."""
        return self._last_step.get(name)

    def finish(self, failed: bool) -> None:
        """Flush and close every logger (end of the launch block, successful or not).

        Never raises: it runs while the block ends, and an exception here would skip the
        final barrier the other ranks wait at. A logger that cannot finish is reported as a
        warning naming it, and the others still finish.
        """
        if not self.write:
            return
        for logger in self.loggers:
            try:
                logger.finalize("failed" if failed else "success")
            except Exception as e:  # noqa: BLE001 - one logger's failure must not lose the others' values
                warnings.warn(
                    f"{logger!r}.finalize() failed, so its last values may be missing: {type(e).__name__}: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def __repr__(self) -> str:
        return f"MetricLog({list(self.loggers)!r}, write={self.write})"
