"""``lite.sharded_init``: build modules where and how they will live."""

from __future__ import annotations

from typing import Any, ContextManager

from scopedlite._api.current import current
from scopedlite._core.scope import WrapperScope

__all__ = ["sharded_init"]


class _ShardedInit(WrapperScope[None]):
    def __init__(self, empty: bool) -> None:
        self.empty = bool(empty)

    def describe(self) -> str:
        return f"lite.sharded_init(empty={self.empty})"

    def _inner_context(self) -> tuple[ContextManager[Any], None]:
        return current().strategy.module_init_context(self.empty), None


def sharded_init(empty: bool = False) -> _ShardedInit:
    """Modules built inside are created on the run's device and in its parameter dtype.

    Sharding strategies shard them as they are built. ``empty=True`` skips weight
    initialisation (memory is allocated, values are garbage): for models whose weights are
    loaded from a checkpoint right after.
    """
    return _ShardedInit(empty)
