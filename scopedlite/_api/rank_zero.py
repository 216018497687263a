"""``lite.rank_zero_first`` and ``lite.print``."""

from __future__ import annotations

import builtins
import contextvars
from types import TracebackType
from typing import Any

from scopedlite._api.collectives import barrier
from scopedlite._api.current import current
from scopedlite._core.scope import Scope

__all__ = ["in_rank_zero_first", "print", "rank_zero_first"]


_first_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.rank_zero_first", default=None)


class _RankZeroFirst(Scope[bool]):
    _var = _first_var

    def __init__(self, local: bool) -> None:
        self.local = bool(local)

    def describe(self) -> str:
        return f"lite.rank_zero_first(local={self.local})"

    def _enter(self) -> bool:
        run = current()
        self._first = run.local_rank == 0 if self.local else run.global_rank == 0
        if not self._first:
            barrier()  # wait for rank 0 to finish the block
        return self._first

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._first and exc_type is None:
            barrier()  # release the others
        return None


def rank_zero_first(local: bool = False) -> _RankZeroFirst:
    """Rank 0 runs the block first (a download, a cache build); the other ranks after it.

    With ``local=True`` the first process of each node goes first. Yields whether this
    process is one of those that go first.
    """
    return _RankZeroFirst(local)


def in_rank_zero_first() -> bool:
    """Whether a ``rank_zero_first`` block is open here: the other ranks are then waiting
    for it to end, so no collective may be called in it."""
    return _first_var.get() is not None


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - the name users expect
    """``print`` on global rank 0 only."""
    if current().is_global_zero:
        builtins.print(*args, **kwargs)
