"""``lite.sharded_init``: build modules where and how they will live."""

from __future__ import annotations

import contextvars
from types import TracebackType
from typing import Any

from scopedlite._run import current
from scopedlite._scope import Scope

__all__ = ["sharded_init"]

_init_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.sharded_init", default=None)


class _ShardedInit(Scope[None]):
    _var = _init_var

    def __init__(self, empty: bool) -> None:
        self.empty = bool(empty)

    def describe(self) -> str:
        return f"lite.sharded_init(empty={self.empty})"

    def _enter(self) -> None:
        self._inner = current().strategy.module_init_context(self.empty)
        self._inner.__enter__()

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._inner.__exit__(exc_type, exc, tb)
        return None


def sharded_init(empty: bool = False) -> _ShardedInit:
    """Modules built inside are created on the run's device and in its parameter dtype.

    Sharding strategies shard them as they are built. ``empty=True`` skips weight
    initialisation (memory is allocated, values are garbage): for models whose weights are
    loaded from a checkpoint right after.
    """
    return _ShardedInit(empty)
