"""A call that every rank makes together, refused at once where some ranks make it alone.

``lite.save``, ``lite.load``, ``lite.setup`` and ``lite.setup_dataloader`` (sharding) run
collectives: made under ``if run.is_global_zero:``, their first collective would meet the
other ranks' next step, and the run would hang or abort. Where the strategy keeps a ledger of
each rank's steps (every multi-rank strategy but xla: ``_strategies/lockstep.py``), the call is
checked against it first and refused on the ranks that make it alone, naming what the others
do and the fix, before anything is sent; a script that catches the refusal stays in step.
"""

from __future__ import annotations

from scopedlite._api.current import current
from scopedlite._api.join import active_session

__all__ = ["every_rank_calls"]


def every_rank_calls(call: str, why: str, fix: str, alone: str | None = None) -> None:
    """``call`` (``"lite.save"``) is about to run its first collective: return when every rank
    makes it too (or the strategy cannot tell), raise ``MethodCalledOnSomeRanksError`` on the
    ranks that make it alone. ``why`` says what every rank does in it, ``fix`` the way out,
    ``alone`` what a call on some ranks would do (where it is not to wait in a collective).
    Nothing to check on one process, or inside ``lite.join``, whose session keeps the ranks'
    steps in order."""
    run = current()
    if run.world_size > 1 and active_session(run) is None:
        run.strategy.every_rank_calls(call, why, fix, alone)
