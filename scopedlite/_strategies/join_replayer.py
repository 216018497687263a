"""What each backend supplies to the join session (``replay.py``): a :class:`Replayer`.

One small class per backend - ``ddp/join.py``, ``fsdp/join.py``, ``deepspeed/join.py`` -
installs the hooks through which running ranks announce their steps, and replays those steps
on a rank that serves. ``ProcessGroupStrategy.join`` (``process_group_strategy.py``) is the one
template that builds it and hands it to the session.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from scopedlite._strategies.replay import ReplaySession

__all__ = ["Replayer", "announce_forwards"]


class Replayer(Protocol):
    """What a backend supplies to the session: its hooks and its replays."""

    records_steps: bool  # optimizer.step/zero_grad are local events (DDP, FSDP), not rounds (DeepSpeed)
    # A forward gathers parameters from every rank (FSDP, ZeRO-3): its round is awaited before
    # it, so that a refusal raises on every rank instead of leaving one in the gather.
    forward_communicates: bool

    def install(self, session: ReplaySession) -> contextlib.ExitStack:
        """Hook the models so that running ranks announce forwards (and steps); undone on close."""
        ...

    def module(self, index: int) -> torch.nn.Module:
        """The user's module of model ``index`` (its buffers are kept across a replay)."""
        ...

    def zero_grad_owners(self) -> list[tuple[int, torch.nn.Module]]:
        """The objects whose ``zero_grad()`` is an event, with the model index it zeroes."""
        ...

    def sync_flag(self, index: int) -> bool:
        """Whether the next backward of model ``index`` synchronises gradients."""
        ...

    def buffer_flag(self, index: int) -> bool:
        """Whether the next forward of model ``index`` synchronises buffers (DDP)."""
        ...

    def sync_buffers(self, index: int, source: int) -> None:
        """Synchronise the buffers of model ``index`` from rank ``source`` (DDP)."""
        ...

    def forward(self, index: int, args: Any, kwargs: Any, sync: bool) -> Any:
        """Run model ``index`` on a serving rank; ``sync``: whether the running ranks'
        forward prepared a gradient sync (DDP decides it there)."""
        ...

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool, keep_own: bool) -> None:
        """Backward through ``outputs`` with zero gradients; ``keep_own``: this rank's own
        micro-batches since its last synchronised backward are still to be contributed."""
        ...

    def step(self, index: int) -> None:
        """Take the collective optimizer step of model ``index`` (DeepSpeed)."""
        ...

    def output_scale(self, count: int) -> float:
        """The factor on the running ranks' output gradients when ``count`` replicas run
        (a replica is one rank, except under ``model_parallel``)."""
        ...

    def active_count(self, count: int) -> None:
        """The number of running replicas is now ``count``."""
        ...

    def clip(
        self,
        index: int,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float,
    ) -> Any:
        """The strategy's own ``clip_gradients`` for model ``index`` and ``optimizer``."""
        ...

    def finish(self, authoritative: int) -> None:
        """Every rank has left: make the models' state the same everywhere (DDP: torch's
        final broadcast from the last rank to leave)."""
        ...


def announce_forwards(stack: contextlib.ExitStack, session: ReplaySession, index: int, module: torch.nn.Module) -> None:
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
