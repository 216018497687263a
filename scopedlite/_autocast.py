"""``lite.autocast``: the run's mixed-precision region, or another precision's."""

from __future__ import annotations

import contextvars
from types import TracebackType
from typing import Any

from scopedlite._precision import Precision, precision_for
from scopedlite._run import current
from scopedlite._scope import Scope

__all__ = ["autocast"]

_autocast_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.autocast", default=None)


class _Autocast(Scope[Precision]):
    _var = _autocast_var

    def __init__(self, precision: str | None) -> None:
        self._precision = None if precision is None else precision_for(precision)

    def describe(self) -> str:
        name = self._precision.name if self._precision else None
        return f"lite.autocast({name!r})" if name else "lite.autocast()"

    def _enter(self) -> Precision:
        run = current()
        precision = self._precision or run.precision
        reason = precision.unsupported_reason(run.accelerator)
        if reason:
            raise ValueError(f"lite.autocast(precision={precision.name!r}) on {run.accelerator}: {reason}.")
        self._region = precision.autocast(run.device.type)
        self._region.__enter__()
        return precision

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._region.__exit__(exc_type, exc, tb)
        return None


def autocast(precision: str | None = None) -> _Autocast:
    """Run the block in the run's mixed precision (``"bf16-mixed"``, ``"16-mixed"``).

    With a "-true" precision (the default ``"32-true"``) the block runs without autocast.
    Scopes nest and the innermost wins: ``lite.autocast("32-true")`` inside a bf16 region
    computes in float32. Yields the precision in effect.
    """
    return _Autocast(precision)
