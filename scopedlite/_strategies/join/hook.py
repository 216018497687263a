"""What a backend does in ``lite.join``'s rounds: a :class:`JoinHook` (torch's ``JoinHook``).

The base class is the template: its defaults are right for a backend whose forward is a plain
call of the set-up model, whose optimizer step is local (it travels as an event, see
``events.py``) and which keeps no buffers in step. ``ddp/join.py``, ``fsdp/join.py`` and
``deepspeed/join.py`` override what differs. ``ProcessGroupStrategy.join``
(``process_group_strategy.py``) builds the strategy's hook and hands it to the session
(``session.py``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from scopedlite._strategies.base import Strategy
    from scopedlite._strategies.join.session import JoinSession

__all__ = ["JoinHook", "announce_forwards"]


class JoinHook:
    """How running ranks announce their steps, and how a serving rank replays them.

    ``models`` are the set-up models of the block, in its order; a step names a model by its
    index there.
    """

    # optimizer.step/zero_grad are local events (DDP, FSDP); False: the step is a round of its
    # own (DeepSpeed's, which is collective), replayed by :meth:`step`.
    records_steps = True
    # A forward gathers parameters from every rank (FSDP, ZeRO-3): its round is awaited before
    # it, so that a refusal raises on every rank instead of leaving one in the gather.
    forward_communicates = False
    # A backward inside lite.no_backward_sync still reduces gradients (ZeRO-2/3 reduce each
    # micro-batch's partition): a rank that ran one took part in the others' synchronising one.
    unsynced_backward_communicates = False

    def __init__(
        self, strategy: Strategy, models: tuple[Any, ...], divide_by_initial_world_size: bool, world_size: int
    ) -> None:
        self.strategy = strategy
        self.models = models
        self.divide = divide_by_initial_world_size
        self.world_size = world_size

    # -- the running ranks' side -------------------------------------------------------------
    def install(self, session: JoinSession) -> contextlib.ExitStack:
        """Hook the models so that running ranks announce forwards (and steps); undone on close."""
        stack = contextlib.ExitStack()
        for index, model in enumerate(self.models):
            announce_forwards(stack, session, index, model)
        return stack

    def module(self, index: int) -> torch.nn.Module:
        """The user's module of model ``index`` (its buffers are kept across a replay)."""
        return self.models[index]  # type: ignore[no-any-return]

    def zero_grad_owners(self) -> list[tuple[int, torch.nn.Module]]:
        """The objects whose ``zero_grad()`` is an event, with the model index it zeroes."""
        return list(enumerate(self.models))

    def sync_flag(self, index: int) -> bool:
        """Whether the next backward of model ``index`` synchronises gradients."""
        return True

    def backward_syncs(self, index: int, forward_synced: bool) -> bool:
        """Whether the backward of model ``index`` now beginning synchronises gradients;
        ``forward_synced``: what :meth:`sync_flag` said when its forward began. By default the
        backward decides (FSDP's post-backward reduce-scatter, DeepSpeed's accumulation
        boundary)."""
        return self.sync_flag(index)

    def holds_gradients(self, index: int) -> bool:
        """Whether model ``index`` holds gradients that its next synchronising backward
        reduces again (DDP all-reduces ``param.grad`` as accumulated): a running rank tells
        a serving one, which then contributes what it holds too. False by default: FSDP and
        DeepSpeed reduce a backward's new gradients only."""
        return False

    def buffer_flag(self, index: int) -> bool:
        """Whether the next forward of model ``index`` synchronises buffers (DDP)."""
        return False

    def output_scale(self, count: int) -> float:
        """The factor on the running ranks' output gradients when ``count`` replicas run
        (a replica is one rank, except under ``model_parallel``)."""
        return 1.0

    # -- the serving ranks' side (and both, for clip and finish) ------------------------------
    def sync_buffers(self, index: int, source: int) -> None:
        """Synchronise the buffers of model ``index`` from rank ``source``: called only where
        :meth:`buffer_flag` said so (none by default)."""

    def forward(self, index: int, args: Any, kwargs: Any, sync: bool) -> Any:
        """Run model ``index`` on a serving rank; ``sync``: whether the running ranks'
        forward prepared a gradient sync (DDP decides it there)."""
        return self.models[index](*args, **kwargs)

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool, keep_own: bool) -> None:
        """Backward through ``outputs`` with zero gradients; ``keep_own``: the gradients this
        rank holds are still to be contributed (its own micro-batches since its last
        synchronised backward, or, where :meth:`holds_gradients`, the window's reduced ones)."""
        if outputs:
            torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])

    def step(self, index: int) -> None:
        """The collective part of model ``index``'s optimizer step: none by default (the step
        is local and travels as an event; only a hook with ``records_steps = False`` announces
        steps)."""

    def active_count(self, count: int) -> None:
        """The number of running replicas is now ``count`` (by default :meth:`output_scale`
        reads it when it is needed)."""

    def clip(
        self,
        index: int,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float,
    ) -> Any:
        """The strategy's own ``clip_gradients`` for model ``index`` and ``optimizer``."""
        return self.strategy.clip_gradients(self.models[index], optimizer, max_norm, clip_val, norm_type=norm_type)

    def finish(self, authoritative: int) -> None:
        """Every rank has left: make the models' state the same everywhere (DDP: torch's
        final broadcast from the last rank to leave). By default each rank's state was
        stepped alike already."""


def announce_forwards(stack: contextlib.ExitStack, session: JoinSession, index: int, module: torch.nn.Module) -> None:
    """Open a FORWARD round before each forward of ``module`` (model ``index`` of the
    session) and hand its output to the session, until ``stack`` closes.

    The pre-hook is prepended and registered after the strategy wrapped the module, so it
    runs before the strategy's own (FSDP2's all-gather): a serving rank must hear of the
    forward before it is asked to take part in it.
    """

    def pre(_: Any, args: Any, kwargs: Any) -> None:
        session.before_forward(index, args, kwargs)

    def post(_: Any, args: Any, output: Any) -> Any:
        return session.after_forward(index, output)

    stack.callback(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True).remove)
    stack.callback(module.register_forward_hook(post).remove)
