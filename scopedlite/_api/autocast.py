"""``lite.autocast``: the run's mixed-precision region, or another precision's."""

from __future__ import annotations

from typing import Any, ContextManager

from scopedlite._api.current import current
from scopedlite._core.precision import Precision, precision_for
from scopedlite._core.scope import WrapperScope

__all__ = ["autocast"]


class _Autocast(WrapperScope[Precision]):
    def __init__(self, precision: str | int | None) -> None:
        self._precision = None if precision is None else precision_for(precision)

    def describe(self) -> str:
        name = self._precision.name if self._precision else None
        return f"lite.autocast({name!r})" if name else "lite.autocast()"

    def _inner_context(self) -> tuple[ContextManager[Any], Precision]:
        run = current()
        precision = self._precision or run.precision
        reason = precision.unsupported_reason(run.accelerator)
        if reason:
            raise ValueError(f"lite.autocast(precision={precision.name!r}) on {run.accelerator}: {reason}.")
        return precision.autocast(run.device.type), precision


def autocast(precision: str | int | None = None) -> _Autocast:
    """Run the block in the run's mixed precision (``"bf16-mixed"``, ``"16-mixed"``).

    With a "-true" precision (the default ``"32-true"``) the block runs without autocast.
    Scopes nest and the innermost wins: ``lite.autocast("32-true")`` inside a bf16 region
    computes in float32. Fabric's short spellings are accepted (``"bf16"`` is
    ``"bf16-mixed"``). Yields the precision in effect.
    """
    return _Autocast(precision)
