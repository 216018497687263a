"""The active run and the accessor every function of scopedlite uses to find it."""

from __future__ import annotations

import contextvars
import datetime
import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._precision import PRECISIONS, Precision

if TYPE_CHECKING:
    from scopedlite._strategies._base import Strategy

__all__ = ["Run", "current"]


@dataclass(frozen=True)
class Run:
    """One process's view of a parallel run: where it sits in the world and how it computes.

    A ``Run`` is what ``with lite.launch(...) as run:`` yields and what :func:`current`
    returns. The names match Lightning Fabric's, so code written against ``fabric.global_rank``
    reads the same here.

    Attributes:
        global_rank: Rank of this process among all processes of the run.
        local_rank: Rank of this process on its node.
        node_rank: Index of this process's node.
        world_size: Number of processes in the run.
        local_world_size: Number of processes on this node.
        device: The device this process computes on.
        precision: The run's precision setting.
        strategy: The strategy object that carries out setup, backward and collectives.
        accelerator: ``"cpu"``, ``"cuda"`` or ``"mps"``.
        timeout: How long a collective may wait for the other ranks before it fails.
    """

    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    precision: Precision
    accelerator: str
    strategy: Strategy = field(repr=False, compare=False)
    timeout: datetime.timedelta = field(default=datetime.timedelta(minutes=30), repr=False)
    launched: bool = field(default=True, repr=False)

    @property
    def is_global_zero(self) -> bool:
        """True on the process with global rank 0."""
        return self.global_rank == 0

    @property
    def is_local_zero(self) -> bool:
        """True on the process with local rank 0 of its node."""
        return self.local_rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


# Holds the innermost open `launch` scope (see scopedlite._launch); its `.run` is the run.
launch_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.launch", default=None)


def current() -> Run:
    """Return the active run.

    Inside ``with lite.launch(...)`` that is the launched run. Outside any launch a default
    single-process run on the best available device is returned (CUDA, else MPS, else CPU),
    so the same functions work in a plain script, a test or a notebook cell. Threads start
    without the launched run; use :func:`scopedlite.carry` to hand it over on purpose.
    """
    scope = launch_var.get()
    if scope is not None:
        return scope.run  # type: ignore[no-any-return]
    return _default_run(os.getpid())


@functools.lru_cache(maxsize=1)
def _default_run(pid: int) -> Run:
    # Keyed by pid so a forked child builds its own default run instead of sharing one whose
    # strategy state (e.g. a gradient scaler) belongs to the parent.
    from scopedlite._strategies._single import SingleDeviceStrategy

    if torch.cuda.is_available():
        # current_device() would create a CUDA context, and a later fork launch would be refused
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        accelerator, device = "cuda", torch.device("cuda", index)
    elif torch.backends.mps.is_available():
        accelerator, device = "mps", torch.device("mps")
    else:
        accelerator, device = "cpu", torch.device("cpu")
    precision = PRECISIONS["32-true"]
    strategy = SingleDeviceStrategy()
    run = Run(
        global_rank=0,
        local_rank=0,
        node_rank=0,
        world_size=1,
        local_world_size=1,
        device=device,
        precision=precision,
        accelerator=accelerator,
        strategy=strategy,
        launched=False,
    )
    strategy.start(run, rendezvous=None)
    return run
