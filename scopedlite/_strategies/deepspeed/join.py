"""The DeepSpeed side of ``lite.join``: hooks and replays for the session (see join/session.py).

DeepSpeed's public engine methods are wrapped on the instance for the block:

- ``engine.forward`` announces the forward before the engine runs (ZeRO-3 gathers parameters
  inside it) and wraps the outputs so that their backward is announced too;
- ``engine.step`` announces a round of its own: ZeRO's step is collective (gradient-norm and
  overflow all-reduces, the all-gather of updated partitions), so a joined rank must step too;
- a backward inside ``lite.no_backward_sync`` (the engine's accumulation boundary lowered) is
  replayed inside it too;
- ``engine.backward`` scales the loss by ``world_size / active`` when
  ``divide_by_initial_world_size=False``: DeepSpeed always averages over the world and has no
  setter for the divisor.

A joined rank replays the backward as ``engine.backward`` of a zero-weighted sum of the
outputs the running ranks' loss used, so every hook and reduction of the engine runs as on
the running ranks, with a zero contribution. ``zero_grad`` is the engine's business (it
zeroes after each step). ``lite.clip_gradients`` clips the engine's full gradients on every
rank (a serving one too). Buffers are each rank's own, as DeepSpeed leaves them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._strategies.deepspeed.engines import accumulating
from scopedlite._strategies.deepspeed.logs import filtered_warnings
from scopedlite._strategies.join.events import wrap_method
from scopedlite._strategies.join.hook import JoinHook

if TYPE_CHECKING:
    from scopedlite._strategies.deepspeed.strategy import DeepSpeedStrategy
    from scopedlite._strategies.join.session import JoinSession

__all__ = ["DeepSpeedJoinHook"]


class DeepSpeedJoinHook(JoinHook):
    """Hooks and replays of DeepSpeed engines for :class:`~scopedlite._strategies.join.session.JoinSession`."""

    records_steps = False

    def __init__(
        self, strategy: DeepSpeedStrategy, engines: tuple[Any, ...], divide_by_initial_world_size: bool, world_size: int
    ) -> None:
        super().__init__(strategy, engines, divide_by_initial_world_size, world_size)
        self.forward_communicates = strategy.stage == 3  # ZeRO-3 gathers its parameters
        self.unsynced_backward_communicates = strategy.stage >= 2  # ZeRO-2/3 reduce every backward
        self.count = world_size

    def install(self, session: JoinSession) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for index, engine in enumerate(self.models):
            # the engine's own forward, backward and step, wrapped on the engine for the block
            # (the face's backward and step run the strategy's checked backward and the
            # optimizer's step, which call these; a call of the face calls the engine)
            own = self.strategy.engine(engine)
            forward, backward, step = engine.forward, own.backward, own.step

            def announced_forward(*args: Any, index: int = index, forward: Any = forward, **kwargs: Any) -> Any:
                session.before_forward(index, args, kwargs)
                return session.after_forward(index, forward(*args, **kwargs))

            def scaled_backward(loss: torch.Tensor, *args: Any, backward: Any = backward, **kwargs: Any) -> Any:
                if not self.divide and not session.serving and self.count != self.world_size:
                    loss = loss * (self.world_size / self.count)
                return backward(loss, *args, **kwargs)

            def announced_step(*args: Any, index: int = index, step: Any = step, **kwargs: Any) -> Any:
                session.before_step(index)
                return step(*args, **kwargs)

            wrap_method(stack, own, "forward", announced_forward)
            wrap_method(stack, own, "backward", scaled_backward)
            wrap_method(stack, own, "step", announced_step)
        return stack

    def module(self, index: int) -> torch.nn.Module:
        return self.models[index].module  # type: ignore[no-any-return]

    def zero_grad_owners(self) -> list[tuple[int, torch.nn.Module]]:
        return []  # the engine zeroes its gradients after each step

    def sync_flag(self, index: int) -> bool:
        # lite.no_backward_sync lowers the engine's boundary; its config may accumulate too
        return bool(self.models[index].is_gradient_accumulation_boundary())

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool, keep_own: bool) -> None:
        if not outputs:
            return
        engine = self.models[index]
        zero = sum((t.float() * 0).sum() for t in outputs)
        with filtered_warnings(), accumulating(engine) if not sync else contextlib.nullcontext():
            self.strategy.engine(engine).backward(zero)  # the engine's own: a replay, not checked
        if sync:
            self.strategy.note_synced(engine)

    def step(self, index: int) -> None:
        # Through the user's optimizer, as on the active ranks: its step is rerouted to the
        # engine, and the engine's own call back into it must reach the real step.
        engine = self.models[index]
        optimizer = self.strategy.optimizer_of(engine)
        (optimizer if optimizer is not None else engine).step()

    def active_count(self, count: int) -> None:
        self.count = count  # the divisor is set by scaling the loss in engine.backward
