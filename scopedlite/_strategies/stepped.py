"""The steps the optimizers took since the ranks last compared, and a digest of them.

An LR scheduler stepped on some ranks only (``if rank == 0: scheduler.step(val_loss)`` after
an evaluation on rank 0, or ``scheduler.step(loss)`` with each rank's own loss) has each rank
step its replica (or its shard) with its own learning rate: under DDP and DeepSpeed the
replicas part without a word, and ``lite.save`` writes rank 0's; under FSDP the model is no
longer one model. The ranks already compare their training forwards
with one all-reduce at each backward that reduces gradients (``ddp/counted.py``,
``deepspeed/counted.py``); that all-reduce also carries :meth:`SteppedOptimizers.digest`, and
where the digests differ the backward raises on every rank (:func:`different_settings`).

What is digested: each step an optimizer set up in the run took since the last comparison, by
the optimizer's setup place and the numbers of its parameter groups the step used (``lr``,
``momentum``, ``betas``, ``weight_decay``, ...), read just before it (torch's public
``Optimizer.register_step_pre_hook``; under DeepSpeed the engine step that the user's
``optimizer.step()`` runs), and the ``lite.clip_gradients`` calls made before it (where a
rank clips the gradients it holds with no collective, a clip on rank 0 alone is otherwise
unseen). So the first step taken with a rate one rank changed alone, or after a clip one
rank made alone, is refused at the next backward, before a second one. Every rank of a
correct program takes the same steps with the same numbers, and a ``lite.join`` block's
joined ranks replay the others' steps, so the digests agree; an optimizer stepped on one
rank only is refused too.

Why not the numbers as they are at the comparison, which would refuse one step earlier: that
needs the optimizers themselves at the comparison. Holding the ones that stepped until then
keeps a model the user dropped (its parameters, on its device) alive into the next one's
setup; reading the ones still alive depends on each rank's garbage collector (a dropped
optimizer one rank has not collected yet), and a digest of those refused correct scripts.
What a step used is known to every rank alike, whatever it later drops.

Under fsdp and model_parallel no exchange of ours runs at the backward: there
:func:`compared` posts one of its own, the digest alone, before ``lite.backward`` and reads
it after (docs/strategies.md).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import numbers
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scopedlite._strategies.set_up import SetUpObjects
from scopedlite._strategies.skipped_step import ranges, spread

__all__ = ["SteppedOptimizers", "compared", "different_settings"]


class SteppedOptimizers:
    """The steps the optimizers of one run took since the last :meth:`digest`."""

    def __init__(self) -> None:
        self._places = 0
        self._steps: dict[int, _Steps] = {}  # setup place -> its steps, until digested
        self._clips: list[str] = []  # lite.clip_gradients calls since the last step ("clip_val=0.5")
        self.last: list[tuple[int, int, list[float], list[str]]] = []  # the last digest's (place, steps, rates, clips)

    def noter(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Give ``optimizer`` the next place; returns what notes a step of it, called just
        before the step (DeepSpeed's engine step, once per user's step). Holds the optimizer
        weakly."""
        self._places += 1
        place, held = self._places, weakref.ref(optimizer)

        def noted() -> None:
            stepping = held()
            if stepping is not None:
                clips, self._clips = self._clips, []
                self._steps.setdefault(place, _Steps()).add(stepping.param_groups, clips)

        return noted

    def clipped(self, how: str) -> None:
        """``lite.clip_gradients`` (``how``: its arguments, ``"max_norm=1.0"``) was called
        outside ``lite.join``: digested with the next optimizer step. Where each rank clips
        the gradients it holds (ddp; a clamp of values under fsdp) a clip made on some ranks
        only runs no collective, and the ranks' steps would part without a word."""
        self._clips.append(how)

    def watch(self, optimizer: torch.optim.Optimizer, set_up: SetUpObjects) -> None:
        """Note each step of ``optimizer`` (set up in the run of ``set_up``) until the run
        ends: torch's step pre-hook, run by the optimizer's real step whoever calls it."""
        noted = self.noter(optimizer)
        set_up.at_end(optimizer.register_step_pre_hook(lambda *_: noted()).remove)

    def digest(self) -> int:
        """A 62-bit digest of the steps taken since the last call: each optimizer's place,
        its number of steps and the numbers they used; starts the next interval (62 bits: it
        is sent with its negation in an int64 tensor, ``skipped_step.spread``)."""
        total = hashlib.blake2b(digest_size=8)
        self.last = []
        for place, steps in sorted(self._steps.items(), key=lambda item: item[0]):
            total.update(array.array("q", [place, steps.count]).tobytes() + steps.used.digest())
            self.last.append((place, steps.count, steps.rates, steps.clips))
        self._steps.clear()
        self._clips.clear()
        return int.from_bytes(total.digest(), "little") >> 2


class _Steps:
    """One optimizer's steps in an interval: how many, a running digest of the numbers each
    used and of the clips before it, and the learning rates and clips of the latest (for the
    error)."""

    def __init__(self) -> None:
        self.count = 0
        self.used = hashlib.blake2b(digest_size=8)
        self.rates: list[float] = []
        self.clips: list[str] = []

    def add(self, groups: list[dict[str, Any]], clips: list[str]) -> None:
        values: list[float] = [float(len(groups))]
        for group in groups:
            for key in sorted(group):
                if key != "params":
                    _add_numbers(group[key], values)
        self.count += 1
        self.used.update(array.array("d", values).tobytes() + "|".join(clips).encode() + b"\0")
        self.rates = [_rate(group.get("lr")) for group in groups]
        self.clips = clips


def _add_numbers(value: Any, into: list[float]) -> None:
    """Append ``value``'s numbers to ``into`` (an int, a float, a bool, a tuple of them, a small
    tensor's values); anything else is left out (an object's repr may hold its address)."""
    if isinstance(value, numbers.Real):
        into.append(float(value))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _add_numbers(item, into)
    elif isinstance(value, torch.Tensor) and value.numel() <= 16:
        into.extend(float(x) for x in value.detach().flatten().tolist())


def _rate(value: Any) -> float:
    """A learning rate as a float (NaN where it is not one number)."""
    one = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    return float(value) if one else float("nan")


def different_settings(stepped: SteppedOptimizers, harm: str) -> RuntimeError:
    """The error for ranks whose optimizers' steps since the last comparison differ (this
    rank's, from ``stepped.last``); ``harm``: what they did to the model."""
    mine = "; ".join(
        f"optimizer {place} (in setup order) stepped {count} time(s), the last at learning rates {rates}"
        + (f", after lite.clip_gradients({'), lite.clip_gradients('.join(clips)})" if clips else "")
        for place, count, rates, clips in stepped.last
    )
    return RuntimeError(
        "The ranks' optimizers stepped differently since the previous backward: a different "
        "number of times, with different hyperparameters (learning rates, momenta, ...), or "
        f"with gradients clipped differently. This rank: {mine or 'no optimizer stepped'}. "
        f"So {harm}. An LR scheduler was stepped on some ranks only (`if rank == 0: "
        "scheduler.step(val_loss)` after an evaluation on rank 0), or with a value each rank "
        "computed for itself (its own loss), or a param group was changed, an optimizer "
        "stepped or lite.clip_gradients called, on one rank only. Step every optimizer and "
        "scheduler, and clip, on every rank, with the same value: "
        '`scheduler.step(float(lite.all_reduce(val_loss, op="mean")))`, or '
        "`lite.broadcast(val_loss, src=0)` from the rank that evaluated; then start again from "
        "a checkpoint saved before this point."
    )


@contextlib.contextmanager
def compared(stepped: SteppedOptimizers | None, group: Any, harm: str) -> Iterator[None]:
    """Around a backward at which no other exchange of ours runs (fsdp, model_parallel): the
    ranks' digests of ``stepped`` (None: nothing to compare, one rank or inside ``lite.join``)
    travel in one all-reduce on ``group`` (a CPU group; None: the default group), posted
    before the backward and read after it, when the backward's own collectives have brought
    every rank past the post; the block raises :func:`different_settings` on every rank where
    they differ (``harm``: what the ranks did to the model). Every rank ran the backward, so a
    script that catches the error is still in step."""
    if stepped is None:
        yield
        return
    extremes = spread(stepped.digest())
    work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True)
    yield  # an error of the backward is raised as it is, the comparison left unread
    work.wait()  # a peer gone: its error, as the backward's own collectives would raise
    ((least, most),) = ranges(extremes)
    if least != most:
        raise different_settings(stepped, harm)
