"""``lite.log`` and ``lite.log_dict``: metrics to the loggers given to ``launch(loggers=...)``.

Call them on every rank, as the rest of the loop: each call is checked everywhere and written
once, by global rank 0, with rank 0's value (reduce first, ``lite.all_reduce(x, op="mean")``,
for a value of the whole run). Outside any launch there are no loggers: the calls are checked
and write nothing, as Fabric's do without loggers.
"""

from __future__ import annotations

from typing import Any, Mapping

from scopedlite._core.run import active_launch
from scopedlite._loggers.base import MetricLog

__all__ = ["last_step", "log", "log_dict"]


def _metric_log() -> MetricLog:
    scope = active_launch()  # the open launch scope, which holds the run's record
    return scope.metrics if scope is not None else MetricLog((), write=False)


def log(name: str, value: Any, step: int | None = None) -> None:
    """Log one number (a Python number or a one-element tensor) under ``name``.

    Args:
        name: The metric's name (a CSV row's ``name``, a TensorBoard tag).
        value: The value; a tensor is read with ``.item()`` on rank 0.
        step: Where it goes on the x axis. Steps of one name must increase; ``None`` takes
            the name's next step (0, 1, 2, ... when never given).

    Raises:
        TypeError, ValueError: A value that is not one number, a step that is not after the
            name's last one; raised on every rank.
    """
    _metric_log().record({name: value}, step)


def log_dict(metrics: Mapping[str, Any], step: int | None = None) -> None:
    """Log several numbers at once, all at ``step`` (see :func:`log`)."""
    _metric_log().record(metrics, step)


def last_step(name: str) -> int | None:
    """The last step ``name`` was logged at in the active run (None: never), the same on
    every rank; a later ``lite.throughput`` block continues its axis from there."""
    return _metric_log().last_step(name)
