"""The join session's event recorder: local actions the ranks that serve must replay.

``optimizer.step()`` (where it is local: DDP, FSDP), ``optimizer.zero_grad()``, a set-up
model's ``zero_grad()`` and ``scheduler.step()`` have no collective of their own. While some
rank serves, the ranks still running record them as :class:`~message.Event` s, carried on
their next step message, and a serving rank applies them in order. Also here: the policing that
keeps a serving rank's learning rates those of the running ranks.

LR schedulers hold their optimizer but the optimizer does not know them: the run notes every
scheduler as it is built (``SetUpObjects.watch_schedulers`` in ``_strategies/set_up.py``), and
the recorder asks it for those of the block's optimizers once per block, when a rank may start
serving (``start``). Their order is the order they were built in, the same on every rank.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch

from scopedlite._strategies.join.message import Action, Event

__all__ = ["EventRecorder", "wrap_method"]


class EventRecorder:
    """Records the local actions of a running rank and applies those of the others."""

    def __init__(
        self,
        optimizers: tuple[torch.optim.Optimizer, ...],
        models: tuple[torch.nn.Module, ...],
        record_steps: bool,
        schedulers_of_run: Callable[[], list[Any]],
    ) -> None:
        self.optimizers = optimizers
        self._schedulers_of_run = schedulers_of_run  # the run's schedulers on ``optimizers``
        self.models = models
        self.record_steps = record_steps  # False where the step is a collective round (DeepSpeed)
        self.schedulers: list[Any] = []
        self.recording = False
        self.pending: list[Event] = []
        self._lrs: list[tuple[float, ...]] = []
        self._in_scheduler = 0
        self._scheduler_steps = 0  # outermost scheduler.step() calls since install, own or replayed
        self._stack = contextlib.ExitStack()
        self._started = False

    # -- installing ------------------------------------------------------------------------
    def start(self) -> None:
        """Record from now on (hooks installed on the first call of a block)."""
        if not self._started:
            self._started = True
            self._install()
        self._lrs = [_lrs(o) for o in self.optimizers]
        self.pending = []
        self.recording = True

    def pause(self) -> None:
        """Stop recording: every rank runs its own code again."""
        self.recording = False
        self.pending = []

    def close(self) -> None:
        self.recording = False
        self._stack.close()

    def _install(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            if self.record_steps:
                handle = optimizer.register_step_post_hook(lambda opt, a, k, i=i: self._optimizer_stepped(i))
                self._stack.callback(handle.remove)
                self._wrap(optimizer, "zero_grad", lambda previous, i=i: self._zero_grad(previous, Action.ZERO_GRAD, i))
        for m, model in enumerate(self.models):
            self._wrap(model, "zero_grad", lambda previous, m=m: self._zero_grad(previous, Action.MODULE_ZERO_GRAD, m))
        self.schedulers = self._schedulers_of_run()
        for j, scheduler in enumerate(self.schedulers):
            self._wrap(scheduler, "step", lambda previous, j=j, s=scheduler: self._scheduler_step(previous, j, s))

    def _wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        wrap_method(self._stack, obj, name, make(getattr(obj, name)))

    # -- recording ---------------------------------------------------------------------------
    def take(self, limit: int) -> tuple[Event, ...]:
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        return tuple(taken)

    def _record(self, event: Event) -> None:
        if self.recording:
            self.pending.append(event)

    def _optimizer_stepped(self, i: int) -> None:
        if self.recording:
            self._record(Event(Action.OPTIMIZER_STEP, i, self.check_lr(self.optimizers[i])))

    def _zero_grad(self, previous: Any, action: Action, index: int) -> Any:
        def zero_grad(set_to_none: bool = True) -> None:
            previous(set_to_none=set_to_none)
            self._record(Event(action, index, float(set_to_none)))

        return zero_grad

    def _scheduler_step(self, previous: Any, j: int, scheduler: Any) -> Any:
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

        def step(*args: Any, **kwargs: Any) -> Any:
            if plateau and self.recording:
                raise RuntimeError(
                    "ReduceLROnPlateau.step(metric) cannot be called inside lite.join on several "
                    "processes: ranks that ran out of data must mirror it but do not "
                    "know the metric. Call scheduler.step(metric) after the join block."
                )
            self._in_scheduler += 1
            try:
                result = previous(*args, **kwargs)
            finally:
                self._in_scheduler -= 1
            if self._in_scheduler == 0:
                self._scheduler_steps += 1
            if self._in_scheduler == 0 and self.recording:
                self._record(Event(Action.SCHEDULER_STEP, j))
                for k, optimizer in enumerate(self.optimizers):
                    if optimizer is scheduler.optimizer:
                        self._lrs[k] = _lrs(optimizer)
            return result

        return step

    def scheduler_steps(self) -> int:
        """How often this rank stepped a scheduler since the hooks were installed (at the same
        round on every rank), its own steps and those it replayed, counting a scheduler that
        steps others (``SequentialLR``) once: compared once every rank has left. Not the
        schedulers' ``last_epoch``: ``SequentialLR`` moves two of them by one step, or sets
        one back to 0."""
        return self._scheduler_steps

    # -- learning rates ------------------------------------------------------------------------
    def check_lr(self, optimizer: torch.optim.Optimizer) -> float:
        """Refuse a learning rate changed by hand: ranks that serve would not see it."""
        i = self.index_of(optimizer)
        now = _lrs(optimizer)
        if self.recording and now != self._lrs[i]:
            group = next(g for g, (a, b) in enumerate(zip(now, self._lrs[i])) if a != b)
            raise RuntimeError(
                f"The learning rate of optimizer {i}, param group {group}, changed from "
                f"{self._lrs[i][group]} to {now[group]} inside lite.join by something the run does "
                "not know: a change by hand, or an LR scheduler built before `lite.launch` or inside "
                "the join block. Ranks that ran out of data step their shards too and cannot see "
                "it. Change it with a torch LR scheduler built inside `with lite.launch(...)` and "
                "before `with lite.join(...)` (one built before the launch block is passed: "
                "`lite.join(model, scheduler)`), or outside the block."
            )
        return math.fsum(now)

    def compare_lr(self, optimizer: torch.optim.Optimizer, value: float, rank: int) -> None:
        mine = math.fsum(_lrs(optimizer))
        if not math.isclose(mine, value, rel_tol=1e-9, abs_tol=1e-15):
            raise RuntimeError(
                f"Inside lite.join the ranks still active step with learning rate(s) summing to "
                f"{value:.6g}, but rank {rank}, which ran out of data, has {mine:.6g}. An LR "
                "scheduler stepped after the loop inside the join block runs early on ranks "
                "that finish early: call it after the `with lite.join(...)` block."
            )

    def index_of(self, optimizer: torch.optim.Optimizer) -> int:
        for i, known in enumerate(self.optimizers):
            if known is optimizer:
                return i
        raise ValueError(
            "lite.join got an optimizer that was not set up in this run. Set it up with the "
            "model: `model, opt = lite.setup(model, opt)`."
        )

    # -- applying --------------------------------------------------------------------------------
    def apply(self, event: Event, rank: int) -> None:
        """Replay one event of the running ranks on this (serving) rank."""
        if event.action == Action.OPTIMIZER_STEP:
            optimizer = self.optimizers[event.index]
            self.compare_lr(optimizer, event.value, rank)
            optimizer.step()
        elif event.action == Action.ZERO_GRAD:
            self.optimizers[event.index].zero_grad(set_to_none=bool(event.value))
        elif event.action == Action.MODULE_ZERO_GRAD:
            self.models[event.index].zero_grad(set_to_none=bool(event.value))
        elif event.action == Action.SCHEDULER_STEP:
            if event.index >= len(self.schedulers):
                raise RuntimeError(
                    f"Inside lite.join the ranks still active stepped LR scheduler #{event.index}, "
                    f"but rank {rank} knows {len(self.schedulers)} on the block's optimizers. Build "
                    "the same schedulers on every rank, inside `with lite.launch(...)` and before the "
                    "join block (or pass them: `lite.join(model, scheduler)`)."
                )
            self.schedulers[event.index].step()


def _lrs(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    return tuple(
        float(g["lr"]) if not isinstance(g["lr"], torch.Tensor) else float(g["lr"].item())
        for g in optimizer.param_groups
    )


def wrap_method(stack: contextlib.ExitStack, obj: Any, name: str, wrapper: Any) -> None:
    """Set ``obj.name = wrapper`` on the instance until ``stack`` closes."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, wrapper)

    def restore() -> None:
        if vars(obj).get(name) is wrapper:
            if had_own:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)

    stack.callback(restore)
