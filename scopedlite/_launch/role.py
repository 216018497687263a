"""How one process takes part in a launch block: one small class per role.

- :class:`Solo`: the run is this one process (``launcher="none"``).
- :class:`External`: a process of a world someone else started (torchrun, SLURM, MPI, ...).
- ``Worker`` (``worker.py``): a rank our launcher started, by re-executing the script or by
  forking; it reports its failures to rank 0 and leaves the process at the end of the block.
- ``Parent`` (``parent.py``): rank 0 of a world we start; it starts and supervises the
  workers and reports their failures.

Every role starts the run the same way (:meth:`Role.start_run`) and keeps all its state in
attributes set in ``__init__``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from scopedlite._cluster.environments import World
from scopedlite._comm.debug import check_same_collective, debug_enabled
from scopedlite._comm.distributed import (
    block_end_prefix,
    end_of_block_barrier,
    final_gloo_barrier,
    meet_at_block_end,
    run_store,
    store_connection,
)
from scopedlite._core.process import this_process
from scopedlite._core.run import Placement, Run
from scopedlite._hardware.machine import Machine
from scopedlite._launch.signals import SignalWatch, StopSignals
from scopedlite._launch.stacks import FatalStacks
from scopedlite._launch.start import threads_per_process
from scopedlite._launch.watchdog import Diagnosis, HangWatchdog, Limits
from scopedlite._plan import Plan
from scopedlite._strategies.base import Rendezvous

__all__ = ["CoreShare", "External", "Role", "Solo", "stop_quietly"]


class CoreShare:
    """Each of N local processes gets ``max(1, C // N)`` torch threads, as under Fabric,
    unless the user (or torchrun) set ``OMP_NUM_THREADS``; the old count comes back after."""

    def __init__(self) -> None:
        self._previous: int | None = None

    def share(self, plan: Plan, local_world_size: int, threads: int | None = None) -> None:
        if "OMP_NUM_THREADS" in os.environ or plan.accelerator != "cpu" or local_world_size < 2:
            return
        if self._previous is None:
            self._previous = torch.get_num_threads()
        torch.set_num_threads(threads or threads_per_process(Machine.probe().cpu_count, local_world_size))

    def restore(self) -> None:
        if self._previous is not None:
            torch.set_num_threads(self._previous)
            self._previous = None


class Role(ABC):
    """One process's part in one launch block."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.run: Run | None = None
        self.world_of_run: World | None = None
        self.signals: StopSignals | None = None
        self.fatal_stacks: FatalStacks | None = None
        self.watchdog: HangWatchdog | None = None
        self.cores = CoreShare()

    @abstractmethod
    def enter(self) -> Run:
        """Start this process's part of the run and return its :class:`Run`."""

    def body_begins(self) -> None:  # noqa: B027 - a no-op unless the role supervises workers
        """The block's body starts: a role that supervises workers interrupts the main thread
        when one fails, from here until :meth:`quiet`."""

    def quiet(self) -> None:  # noqa: B027 - a no-op unless the role supervises workers
        """Stop interrupting the main thread asynchronously: the block has ended (a role that
        supervises workers interrupts it when one fails)."""

    @abstractmethod
    def exit(self, exc: BaseException | None) -> bool | None:
        """End this process's part; the return value is the scope's ``__exit__``'s."""

    def start_run(
        self, world: World, rendezvous: Rendezvous | None, forward: Callable[[int], None] | None = None
    ) -> Run:
        """Place this process in ``world``, start a fresh copy of the plan's strategy there,
        and handle SIGTERM for the block (``forward``: pass it on to our workers)."""
        plan = self.plan
        if plan.accelerator in ("cpu", "mps"):
            device = torch.device(plan.accelerator)
        else:
            device = torch.device(plan.accelerator, plan.devices[world.local_rank])
        placement = Placement(
            global_rank=world.global_rank,
            local_rank=world.local_rank,
            node_rank=world.node_rank,
            world_size=world.world_size,
            local_world_size=world.local_world_size,
            device=device,
            precision=plan.precision,
            accelerator=plan.accelerator,
            timeout=plan.timeout,
        )
        strategy = plan.strategy.fresh()
        run = Run.of(placement, strategy)
        try:
            strategy.start(placement, rendezvous)
        except BaseException:
            stop_quietly(strategy)  # a strategy failing halfway must not leak its group
            raise
        self.run = run
        self.world_of_run = world
        self.signals = StopSignals(forward).install()
        self.fatal_stacks = FatalStacks().install() if world.world_size > 1 else None
        return run

    def end_signals(self) -> None:
        """The block's signal handling ends: SIGTERM's, and the stacks of a fatal signal."""
        if self.signals is not None:
            self.signals.uninstall()
            self.signals = None
        if self.fatal_stacks is not None:
            self.fatal_stacks.uninstall()
            self.fatal_stacks = None

    def start_watchdog(
        self,
        stop_seen: Callable[[], bool],
        end_run: Callable[[Diagnosis], None] | None = None,
        exits_itself: bool = False,
    ) -> None:
        """Watch this rank for a stall for the rest of the block (``watchdog.py``): one
        thread, where the run has several ranks, a store and a limit that is on."""
        run = self.run
        assert run is not None
        limits = Limits(self.plan.hang_timeout, self.plan.term_grace)
        world = self.world_of_run
        assert world is not None
        store = store_connection(world, run.strategy.connection) if run.world_size > 1 and limits.active else None
        if store is None:
            return
        prefix = f"scopedlite/watch/{this_process.blocks_entered()}"
        self.watchdog = HangWatchdog(
            run.global_rank, run.world_size, store, prefix, limits, stop_seen, end_run, exits_itself
        ).start()

    def end_watchdog(self) -> None:
        """Stop watching: the block's body and its end-of-block barrier are over."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def final_barrier(
        self,
        store_wait: float | None = None,
        check: Callable[[], None] | None = None,
        meeting: tuple[Any, str] | None = None,
    ) -> None:
        """Every rank reached the end of the block before any leaves it.

        In a run we started, the ranks meet through the store for up to ``store_wait``
        seconds (see :func:`scopedlite._comm.distributed.end_of_block_barrier`), so the rank
        that times out first can report where everyone was; in a world someone else started,
        through the store it shares and the block's keys (``meeting``: the store and
        :func:`~scopedlite._comm.distributed.block_end_prefix`), up to ``launch(timeout=)``;
        without a store, through the strategy.
        With ``SCOPEDLITE_DEBUG=1`` the end of the block is checked like any collective of
        ours, so a rank still in a collective is named at once. ``check`` is called while the
        ranks meet through the store and may raise to give up (a worker has failed), and so is
        the strategy's :meth:`~scopedlite._strategies.base.Strategy.waiting_at_end` (a rank
        that went on to a step this one never takes).
        """
        run = self.run
        assert run is not None
        if run.world_size <= 1:
            return
        run.strategy.block_body_ended()
        if debug_enabled():
            check_same_collective(
                run.strategy, run.global_rank, run.strategy.comm_device, "the end of the launch block"
            )

        def waiting() -> None:
            if check is not None:
                check()
            run.strategy.waiting_at_end()  # a rank that went on past this end is named at once

        if store_wait is not None and end_of_block_barrier(
            run.strategy.connection, run.global_rank, run.world_size, store_wait, waiting
        ):
            return
        if meeting is not None:
            store, prefix = meeting
            timeout = run.timeout.total_seconds()
            meet_at_block_end(store, prefix, run.global_rank, run.world_size, timeout, waiting)
            return
        if final_gloo_barrier():
            return
        run.strategy.barrier()


class Solo(Role):
    """The run is this one process."""

    def enter(self) -> Run:
        return self.start_run(World("local", 0, 0, 0, 1, 1, "127.0.0.1", 0), None)

    def exit(self, exc: BaseException | None) -> bool | None:
        self.end_signals()
        assert self.run is not None
        self.run.strategy.stop()
        return None


class External(Role):
    """A process of a world someone else started (torchrun, SLURM, MPI, LSF, Kubeflow).

    Nothing is spawned and nothing is killed: those engines own their processes, so the code
    after the block runs on every process.
    """

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.sigterm: SignalWatch | None = None
        self.meeting: tuple[Any, str] | None = None  # where the ranks meet at the block's end

    def enter(self) -> Run:
        world = self.plan.world
        assert world is not None
        self.cores.share(self.plan, world.local_world_size)
        run = self.start_run(world, Rendezvous(world))
        store = run_store(run.strategy.connection) if run.world_size > 1 else None
        if store is not None:  # every rank, as the block starts: the block's keys
            self.meeting = (store, block_end_prefix(store, run.world_size))
        # Nothing of ours can stop the other processes: on a stall each rank ends itself,
        # which ends the job under torchrun's agent, srun and mpirun.
        self.sigterm = SignalWatch()
        self.start_watchdog(self.sigterm.sigterm_seen, exits_itself=True)
        return run

    def exit(self, exc: BaseException | None) -> bool | None:
        assert self.run is not None
        try:
            if exc is None:
                self.final_barrier(meeting=self.meeting)  # every rank done before the group goes
            self.end_watchdog()
            self.end_signals()  # after the barrier: a SIGTERM there is a stop request, not death
            self.run.strategy.stop()
        finally:
            self.end_watchdog()
            self.end_signals()
            if self.sigterm is not None:
                self.sigterm.close()
                self.sigterm = None
            self.cores.restore()
        return None


def stop_quietly(strategy: Any) -> None:
    """Stop ``strategy`` after a failure, whose first error is the one to report."""
    try:
        strategy.stop()
    except Exception:  # noqa: BLE001 - the failure being reported is the one that matters
        pass
