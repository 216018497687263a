"""``lite.should_stop()``: the ranks agree to leave the loop after a SIGTERM.

The first SIGTERM does not kill anything (see ``scopedlite._launch.signals``): it marks a stop
as requested, so the training loop can notice it at a step boundary, save a checkpoint and
leave::

    for x, y in loader:
        ...
        if lite.should_stop():          # True on every rank at the same step
            lite.save("ckpt.pt", state)
            break
"""

from __future__ import annotations

from scopedlite._api.collectives import all_reduce
from scopedlite._api.current import current
from scopedlite._launch.signals import stop_requested

__all__ = ["should_stop"]


def should_stop() -> bool:
    """Whether a stop was requested (SIGTERM) on any rank.

    A collective when the run has several processes (the ranks agree on the answer, so they
    leave the loop at the same step): call it at the same point on every rank.
    """
    local = stop_requested()
    if current().world_size == 1:
        return local
    return bool(all_reduce(int(local), op="max"))
