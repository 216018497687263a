"""Every rank averages the gradients of the same step, or all refuse at the first that differs.

DDP averages each gradient bucket with whatever the other ranks send next on the group. A rank
that skips a step the others take (``if not torch.isfinite(loss): continue`` on one rank,
outside ``lite.join``) pairs its next backward with their current one: from there every step
averages gradients of different steps, silently, until a collective of another size aborts
the process. Counting backwards cannot tell (each rank's k-th backward meets the others'
k-th); counting the training forwards before each can: the skipping rank ran one forward
more. So the set-up model's communication hook runs DDP's all-reduce (torch's public default
hook, or the one the user registers: :func:`use_hook`) and, with the last bucket of each
backward, the ranks compare how many training forwards (gradients enabled) of the model each
has run: one all-reduce of two integers, on a CPU group (the model's under gloo; under NCCL a
gloo group beside it, so that no device synchronises). Where they differ, that backward
raises on every rank, before an optimizer step uses its gradients. The same all-reduce
carries a digest of the optimizers that stepped since, and of their hyperparameters
(``stepped.py``): a scheduler stepped on some ranks only is refused there too.

Inside ``lite.join`` the ranks run different numbers of their own forwards on purpose (the
join protocol keeps them in step): the comparison pauses there, and the counts start again
from zero on every rank when the block ends. So it does inside torch's own ``Join([model])``
(a torchrun script that keeps it): a rank out of data shadows the others' backwards with
zero buckets through this hook, after fewer forwards (:func:`paused_in_torch_join`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from scopedlite._private.torch_internals import ddp_comm_hook, leave_torch_join
from scopedlite._strategies.skipped_step import different_forwards, ranges, spread
from scopedlite._strategies.stepped import SteppedOptimizers, different_settings

__all__ = ["ForwardCount", "count_of", "counted_backwards", "paused_in_torch_join", "use_hook"]

_MARK = "__scopedlite_counted__"


class ForwardCount:
    """One set-up DDP model's training forwards, and the hook that reduces its buckets.

    ``noted`` is told of each training forward too, and ``refused`` of a refusal: the run's
    gather ledger, which has a ``lite.save`` on some ranks only refused at once
    (``lockstep.py``), and whose counts start again where every rank refuses together (None:
    no ledger, one rank). ``stepped``: the run's optimizers that stepped since the ranks last
    compared."""

    def __init__(
        self,
        hook: Callable[..., Any],
        noted: Callable[[], None],
        refused: Callable[[], None] | None,
        stepped: SteppedOptimizers,
    ) -> None:
        self.hook = hook
        self.noted = noted
        self.refused = refused
        self.stepped = stepped
        self.state: Any = None
        self.forwards = 0
        self.paused = False  # inside lite.join

    def forward(self) -> None:
        """The model runs a training forward (gradients enabled)."""
        self.forwards += 1
        self.noted()

    def start_again(self) -> None:
        """Every rank is here together after a block whose ranks ran different numbers of
        their own forwards and steps: the counts, the steps taken and the gather ledger's
        counts start again from here."""
        self.paused, self.forwards = False, 0
        self.stepped.digest()  # drops the steps taken inside the block
        if self.refused is not None:
            self.refused()


class _PausedJoinHook(JoinHook):
    """DDP's own hook for torch's ``Join``, with the counts paused from the block's start (every
    rank builds it in ``Join([model])``) to its end (every rank runs ``post_hook`` together),
    where the model leaves torch's join mode too."""

    def __init__(self, hook: JoinHook, count: ForwardCount, model: Any) -> None:
        self.hook, self.count, self.model = hook, count, model
        count.paused = True

    def main_hook(self) -> None:
        self.hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.hook.post_hook(is_last_joiner)
        leave_torch_join(self.model)
        self.count.start_again()


def paused_in_torch_join(hook: JoinHook, model: Any) -> JoinHook:
    """``hook``, DDP's hook for torch's ``Join([model])``, with the comparison of ``model``'s
    forwards paused for the block: a rank out of data shadows the others' backwards (DDP's
    zero buckets, through this hook) after fewer forwards than they ran, and steps no
    optimizer meanwhile. When the block ends the counts start again, and the model leaves
    torch's join mode (which torch leaves on: an all-reduce at every later forward). A block
    left by an exception (or built with ``enable=False``) never runs ``post_hook``: the
    comparison stays off for that model, as torch itself checks nothing. torch's ``Join``
    leaves the optimizer state of a rank that ran out (its momentum) where it was, and
    broadcasts only the parameters; ``lite.join`` replays the steps instead."""
    count = count_of(ddp_comm_hook(model))
    return hook if count is None else _PausedJoinHook(hook, count, model)


def counted_backwards(
    count_group: Any, noted: Callable[[], None], refused: Callable[[], None] | None, stepped: SteppedOptimizers
) -> Callable[[Any, Any], Any]:
    """The communication hook to register on a set-up DDP model (``state`` is unused: the
    reducing hook's state is kept in its :class:`ForwardCount`). ``count_group``: where the
    counts travel, a CPU group (None: the default group, gloo); ``noted``: told of each
    training forward; ``refused``: of a refusal (on every rank together); ``stepped``: the
    run's optimizers that stepped, compared with the counts."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    count = ForwardCount(allreduce_hook, noted, refused, stepped)

    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        reduced = count.hook(count.state, bucket)
        if not bucket.is_last() or count.paused:
            return reduced
        n = count.forwards
        extremes = spread(n, count.stepped.digest())
        compared = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=count_group, async_op=True)
        both = torch.futures.collect_all([reduced, compared.get_future()])
        return both.then(lambda done: _verdict(done, n, extremes, reduced, count))

    # DDP checks a hook's annotations as objects; under `from __future__ import annotations`
    # they are strings
    counted.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    setattr(counted, _MARK, count)
    return counted


def _verdict(
    done: torch.futures.Future[Any],
    mine: int,
    extremes: torch.Tensor,
    reduced: torch.futures.Future[Any],
    count: ForwardCount,
) -> Any:
    # Either exchange failing (a peer gone) completes ``done`` at once with that error, the
    # other maybe still under way: raise it as it is, as DDP's own reduction would.
    done.value()
    (least, most), settings = ranges(extremes)
    if (most != least or settings[0] != settings[1]) and count.refused is not None:
        count.refused()
    if most != least:
        raise different_forwards(mine, least, most, "DDP would average gradients of different steps")
    if settings[0] != settings[1]:
        raise different_settings(
            count.stepped, "each rank stepped its replica its own way and the replicas no longer agree"
        )
    return reduced.value()


def count_of(registered: Any) -> ForwardCount | None:
    """The :class:`ForwardCount` of the hook ``registered`` on a DDP model (None: not ours)."""
    return getattr(registered, _MARK, None)


def use_hook(registered: Any, state: Any, hook: Callable[..., Any]) -> bool:
    """Let ``hook`` (with ``state``) reduce the buckets under the counting hook ``registered``
    (what DDP holds); False when ``registered`` is not ours."""
    count = count_of(registered)
    if count is None:
        return False
    count.hook, count.state = hook, state
    return True
