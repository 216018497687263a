"""Every rank reduces the gradients of the same step under DeepSpeed, or all refuse at once.

ZeRO reduces gradients in the backward (stages 0-2, and stage 3 for the parameters it keeps
whole) with whatever the other ranks send next. A rank that skips a step the others take
(``if not torch.isfinite(loss): continue`` on one rank, outside ``lite.join``) pairs its next
backward with their current one: from there every step mixes gradients of different steps,
silently, and the run hangs at its end, where a collective meets one of another size. As under
DDP (``ddp/counted.py``), the ranks compare how many training forwards (gradients enabled) of
the model each ran before the backward: the skipping rank ran one more.

DeepSpeed has no communication hook to carry the comparison, so ``lite.backward`` carries it:
one all-reduce of six integers (the model's place in setup order, its count and a digest of the
optimizers that stepped since, ``stepped.py``, as ``skipped_step.spread`` puts them), started
without waiting before ``engine.backward`` and read after it, once the backward's own
reductions have brought the ranks together. It travels on a gloo group of its own: on
DeepSpeed's group its place among the reductions would differ on the rank that skipped. Where
the counts or digests differ, that ``lite.backward`` raises on every rank, before an optimizer
step applies the mixed gradients. DeepSpeed's own ``model.backward(loss)`` is
``lite.backward(loss)`` on the set-up model (``engines.EngineView``), so it is checked too.

Where a forward gathers parameters (ZeRO-3) the skipping rank's next forward would meet the
others' backward before any read: the gather ledger refuses that forward first (lockstep.py),
and the run ends there. Inside ``lite.join`` the ranks run different numbers of
their own forwards on purpose (the join protocol keeps them in step): the comparison pauses
there, and the counts start again from zero on every rank when the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scopedlite._strategies.deepspeed.methods import method_running
from scopedlite._strategies.skipped_step import different_forwards, different_models, ranges, spread
from scopedlite._strategies.stepped import SteppedOptimizers, different_settings

__all__ = ["BackwardCounts"]


class BackwardCounts:
    """The training forwards of a run's DeepSpeed models, compared at every ``lite.backward``."""

    def __init__(self) -> None:
        self.group: Any = None  # made with the first model set up to train (every rank sets it up)
        # told of a refusal (made on every rank together): the gather ledger's counts start again
        self.refused: Callable[[], None] | None = None
        self.forwards: dict[int, int] = {}  # model's place in setup order -> training forwards
        self.stepped = SteppedOptimizers()  # compared with the counts (stepped.py)
        self.paused = False  # inside lite.join

    def start(self) -> None:
        """A model is set up to train: the comparison gets its group (a collective)."""
        if self.group is None:
            self.group = dist.new_group(backend="gloo")

    def forward(self, place: int, noted: Callable[[], None] | None = None) -> None:
        """Model ``place`` runs a forward (one of the user's methods run through it is none);
        ``noted`` is told of a training forward (the gather ledger at stages 0-2)."""
        if torch.is_grad_enabled() and not method_running():
            self.forwards[place] = self.forwards.get(place, 0) + 1
            if noted is not None:
                noted()

    @contextlib.contextmanager
    def compared(self, place: int, reduces: bool) -> Iterator[None]:
        """Around ``engine.backward`` of model ``place``: the ranks' counts are compared while it
        runs, and the block raises on every rank where they differ. ``reduces``: whether this
        backward reduces gradients (not inside an accumulation window at stages 0-1, where
        nothing can pair wrongly, and the window's last backward compares)."""
        if self.paused or self.group is None or not reduces:
            yield
            return
        mine = self.forwards.get(place, 0)
        extremes = spread(place, mine, self.stepped.digest())
        work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        yield  # an error of the backward is raised as it is, the comparison left unread
        work.wait()  # a peer gone: its error, as DeepSpeed's own reduction would raise
        places, counts, settings = ranges(extremes)
        if any(least != most for least, most in (places, counts, settings)) and self.refused is not None:
            self.refused()
        if places[0] != places[1]:
            raise different_models(*places)
        if counts[0] != counts[1]:
            raise different_forwards(mine, *counts, "DeepSpeed would reduce gradients of different steps")
        if settings[0] != settings[1]:
            raise different_settings(
                self.stepped, "each rank stepped its partition its own way and the model is no longer one model"
            )

    def pause(self, paused: bool) -> None:
        """Entering (True) or leaving (False, every rank together) a ``lite.join`` block."""
        self.paused = paused
        self.forwards.clear()
