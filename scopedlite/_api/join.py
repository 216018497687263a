"""``lite.join``: ranks may run out of data at different times without hanging.

The scope asks the run's strategy for a join session (see scopedlite._strategies.join.session). While
it is open, the distributed sampler of ``setup_dataloader`` stops padding, and our
collectives route through the session so they stay correct on the ranks still active.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from scopedlite._api.current import current
from scopedlite._core.run import Run
from scopedlite._core.scope import ScopeError, WrapperScope
from scopedlite._strategies.abilities import SupportsJoin
from scopedlite._strategies.join.members import join_block
from scopedlite._strategies.registry import names_supporting

__all__ = ["active_session", "join"]

_join_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.join", default=None)


class _JoinScope(WrapperScope[None]):
    _var = _join_var

    def __init__(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> None:
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(
                f"divide_by_initial_world_size must be True or False, got {divide_by_initial_world_size!r}."
            )
        self.joinables = joinables
        self.divide = divide_by_initial_world_size

    def describe(self) -> str:
        return "lite.join(...)"

    def _inner_context(self) -> tuple[Any, None]:
        if _join_var.get() is not None:
            raise ScopeError(
                "lite.join is already open in this context; join blocks do not nest. Put "
                "every model of the loop in one `with lite.join(model_a, model_b):`."
            )
        run = current()
        strategy = run.strategy
        if not isinstance(strategy, SupportsJoin):
            supported = names_supporting(SupportsJoin)
            raise RuntimeError(
                f"lite.join is not available under strategy={strategy.name!r}. Strategies "
                f"that support it: {', '.join(repr(s) for s in supported)}."
            )
        self.run: Run = run
        # The scope stays registered while the session finishes (the ranks out of data serve
        # the others' last rounds there), so what those replays call finds the session as in
        # the block; the session lets exceptions through untouched.
        self.session = strategy.join(self.joinables, self.divide)
        return _open_block(self.session), None


@contextlib.contextmanager
def _open_block(session: Any) -> Iterator[None]:
    """The session, inside a block that :func:`in_join` sees on any strategy (the session
    of a process group names its models there too)."""
    with join_block(), session:
        yield


def join(*joinables: Any, divide_by_initial_world_size: bool = True) -> _JoinScope:
    """Let ranks iterate over different numbers of batches: ``with lite.join(model):``.

    Under ``ddp``, ``fsdp``, ``deepspeed`` (stages 1-3) and ``model_parallel`` (per replica:
    its tensor-parallel ranks run out together) a rank that has run out of data
    keeps taking part in the collectives of the ranks still active - it replays their
    forwards and backwards with zero weight and mirrors their optimizer and scheduler steps -
    so training stays correct and every rank ends with the same parameters. ``lite.all_reduce``
    & co. stay correct anywhere in the loop: a reduction covers exactly the ranks still active
    (a mean divides by their count), ``all_gather`` returns the rows of the active ranks only,
    in rank order, and ``barrier``/``broadcast`` complete. The distributed sampler of
    ``setup_dataloader`` neither pads nor drops inside the block, so every sample is seen
    exactly once. On one device it does nothing. What a joined rank cannot mirror (a learning
    rate changed by hand, a loss built from several forwards, ...) raises; see
    docs/uneven-data.md.

    Args:
        *joinables: Models returned by ``lite.setup`` (all models set up in the run when none
            are given), and LR schedulers built before ``lite.launch`` (those built inside
            the launch block are known to the run already).
        divide_by_initial_world_size: Average gradients over all ranks (True: joined ranks
            count as contributing zero) or over the ranks still active (False); under
            ``model_parallel``, over the data-parallel replicas.
    """
    return _JoinScope(joinables, divide_by_initial_world_size)


def active_session(run: Run) -> Any:
    """The join session of ``run`` open in this context, or None."""
    scope = _join_var.get()
    if scope is not None and scope.run is run:
        return scope.session
    return None
