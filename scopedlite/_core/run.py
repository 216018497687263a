"""Where a process sits in a run (:class:`Placement`), the run itself (:class:`Run`), and the
context variable holding the innermost open ``launch`` scope.

Strategies are handed a :class:`Placement` only: what they need to know about the world
(ranks, device, precision, timeout). A :class:`Run` is that placement plus the strategy that
carries it out; it is what users get from ``with lite.launch(...) as run:`` and
``lite.current()``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._core.precision import Precision
from scopedlite._core.process import this_process

if TYPE_CHECKING:
    from scopedlite._strategies.base import Strategy

__all__ = ["Placement", "Run", "active_launch", "launch_var", "launches"]


@dataclass(frozen=True)
class Placement:
    """One process's place in a run and how it computes; what a strategy is started with.

    Attributes:
        global_rank: Rank of this process among all processes of the run.
        local_rank: Rank of this process on its node.
        node_rank: Index of this process's node.
        world_size: Number of processes in the run.
        local_world_size: Number of processes on this node.
        device: The device this process computes on.
        precision: The run's precision setting.
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"`` or ``"xla"``.
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
    timeout: datetime.timedelta = field(default=datetime.timedelta(minutes=30), repr=False)

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


@dataclass(frozen=True)
class Run(Placement):
    """One process's view of a parallel run: where it sits in the world and how it computes.

    A ``Run`` is what ``with lite.launch(...) as run:`` yields and what ``lite.current()``
    returns. The names match Lightning Fabric's, so code written against
    ``fabric.global_rank`` reads the same here. Besides the :class:`Placement` attributes:

    Attributes:
        strategy: The strategy object that carries out setup, backward and collectives.
        launched: False for the default run that is active outside any ``launch``.
    """

    strategy: Strategy = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    launched: bool = field(default=True, repr=False)

    @classmethod
    def of(cls, placement: Placement, strategy: Strategy, launched: bool = True) -> Run:
        """The run of ``strategy`` at ``placement``."""
        values = {f.name: getattr(placement, f.name) for f in dataclasses.fields(Placement)}
        return cls(**values, strategy=strategy, launched=launched)

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this process reads (``setup_dataloader`` shards by it).

        The global rank, except under a strategy that splits the world in more dimensions:
        under ``model_parallel`` the tensor-parallel ranks of one replica share it, and read
        the same batches.
        """
        return self.strategy.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into: the world size, except under a strategy
        that splits the world in more dimensions (``model_parallel``: the number of replicas)."""
        return self.strategy.data_parallel_size

    @property
    def placement(self) -> Placement:
        """This run's placement alone (what its strategy was started with)."""
        return Placement(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Placement)})


# Holds the innermost open `launch` scope (see scopedlite._launch); its `.run` is the run.
launch_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.launch", default=None)


# The launch blocks open in this process, in any thread (process-wide: process.py).
launches = this_process.open_launches


def active_launch() -> Any:
    """The innermost open ``launch`` scope this code runs in: the one in this context, else the
    only one open in this process (code in a thread started inside the block), else None.

    Raises:
        RuntimeError: No scope in this context and several open in this process.
    """
    scope = launch_var.get()
    if scope is not None:
        return scope
    open_here = launches.here()
    if len(open_here) > 1:
        blocks = "; ".join(s.describe() for s in open_here)
        raise RuntimeError(
            f"This thread runs outside any launch block, and {len(open_here)} launch blocks are "
            f"open in this process ({blocks}), so it cannot tell which run it belongs to. Start "
            "the thread with the run it belongs to: `threading.Thread(target=lite.carry(fn))` "
            "from inside that block."
        )
    return open_here[0] if open_here else None
