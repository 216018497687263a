"""A rank our launcher started: a re-executed copy of the script, or a forked child.

It joins the run rank 0 hosts, reports any failure to rank 0 through its error file (a
traceback and a one-line reason), and leaves the process at the end of the block: the code
after the block is the main process's alone.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from scopedlite._cluster.environments import ENV, World
from scopedlite._core.run import Run
from scopedlite._launch.output import install_rank_prefix
from scopedlite._launch.role import Role
from scopedlite._launch.signals import stop_requested
from scopedlite._launch.stacks import enable_stack_dumps, stack_file
from scopedlite._launch.start import ForkChild
from scopedlite._launch.supervise import set_parent_death_signal
from scopedlite._plan import Plan
from scopedlite._strategies.base import Rendezvous

__all__ = ["WORKER_VARIABLES", "Worker", "write_failure"]

# What our launcher puts in a worker's environment (scopedlite._launch.start), except
# OMP_NUM_THREADS, which is the program's to keep.
WORKER_VARIABLES = (
    ENV.TOKEN,
    ENV.SITE,
    ENV.ERROR_FILE,
    ENV.PARENT_PID,
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)

# How much longer than rank 0 a worker waits at the end of the block: when one rank skipped
# a collective, rank 0 times out first and reports where everyone was.
WORKER_GRACE_S = 5.0


class Worker(Role):
    """A rank started by our launcher (see the module docstring).

    Args:
        plan: The launch's plan.
        world: This rank's place in the world rank 0 hosts.
        error_file: Where rank 0 reads this rank's failure (None: print it).
        fork: The fork that made this process, for a forked child.
        threads: Torch threads for a forked child (a re-executed worker got
            ``OMP_NUM_THREADS`` from the launcher instead).
    """

    def __init__(
        self,
        plan: Plan,
        world: World | None,
        error_file: str | Path | None,
        fork: ForkChild | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(plan)
        self.world = world  # a forked child learns its world from rank 0 in enter()
        self.error_file = str(error_file) if error_file else None
        self.fork = fork
        self.threads = threads

    @classmethod
    def re_executed(cls, plan: Plan) -> Worker:
        """This process is a re-executed copy of the script (its world is in ``plan``)."""
        assert plan.world is not None
        return cls(plan, plan.world, os.environ.get(ENV.ERROR_FILE))

    @classmethod
    def forked(cls, plan: Plan, child: ForkChild, error_dir: Path, threads: int) -> Worker:
        """This process is a child rank 0 forked for ``plan``."""
        return cls(plan, None, error_dir / f"rank{child.local_rank}.txt", child, threads)

    def enter(self) -> Run:
        try:
            if self.fork is not None:
                self.cores.share(self.plan, self.plan.local_world_size, self.threads)
                n, rank = self.plan.local_world_size, self.fork.local_rank
                self.world = World("scopedlite", rank, rank, 0, n, n, "127.0.0.1", self.fork.read_port())
            else:  # re-executed: our variables are the launcher's, not the program's
                parent = os.environ.get(ENV.PARENT_PID)
                set_parent_death_signal(int(parent) if parent else None)
                # Rank 0 never had them in its environment, and a process this rank starts (a
                # script that launches a run of its own) must not inherit them.
                for key in WORKER_VARIABLES:
                    os.environ.pop(key, None)
            assert self.world is not None
            install_rank_prefix(self.world.global_rank)
            run = self.start_run(self.world, Rendezvous(self.world))
            self.start_watchdog(stop_requested)  # rank 0 decides and stops us
        except BaseException as e:  # noqa: BLE001 - report it to rank 0 like any failure in the block
            write_failure(self.error_file, e)
            os._exit(1)
        if self.error_file:
            folder = Path(self.error_file).parent
            if str(folder) not in ("", "."):
                enable_stack_dumps(stack_file(folder, run.global_rank))
        return run

    def exit(self, exc: BaseException | None) -> NoReturn:
        run = self.run
        assert run is not None
        code = 0
        if exc is None:
            try:
                self.final_barrier(run.timeout.total_seconds() + WORKER_GRACE_S)
            except BaseException as e:  # noqa: BLE001 - a peer failed while we were finishing
                exc, code = e, 1
        self.end_watchdog()
        self.end_signals()  # after the end-of-block barrier: a SIGTERM there is a stop request
        if exc is not None:
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
            if isinstance(exc, SystemExit) and exc.code is None:
                code = 0
            if code:
                write_failure(self.error_file, exc)
            elif run.world_size > 1:
                # sys.exit(0) inside the block, on this rank alone as far as it knows: the
                # others would wait for it in their next collective. Say so; rank 0 reports it
                # (unless it is leaving the same way, and then nobody is left to care).
                where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
                at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
                write_failure(
                    self.error_file,
                    exc,
                    f"left the launch block early: SystemExit({exc.code!r}){at}, while the other "
                    "ranks were still in it",
                )
        try:
            run.strategy.stop()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Leave now: the code after the block is the main process's alone, and a
            # SystemExit could be caught by the user's own try/except around the block.
            os._exit(code)


def write_failure(path: str | None, exc: BaseException, reason: str | None = None) -> None:
    """Hand rank 0 this worker's traceback, and one line saying what happened.

    The line is the exception's own first line (``raised ValueError: bad batch``), not the
    traceback's last one, which may be a continuation of a multi-line message (a pytest
    assertion's ``+  where ...``). Without an error file the traceback is printed.
    """
    if not path:
        traceback.print_exception(exc)
        return
    if reason is None:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        if isinstance(exc, SystemExit):
            lines = [repr(exc.code)] if exc.code is not None else []
        message = lines[0] if lines else ""
        if message.endswith(":"):  # the message goes on below: a table, a list
            message = message + " " + "; ".join(lines[1:4])
        reason = f"raised {type(exc).__name__}" + (f": {message}" if message else "")
    if len(reason) > 300:
        reason = reason[:297] + "..."
    for name, text in ((f"{path}.reason", reason), (path, "".join(traceback.format_exception(exc)))):
        tmp = f"{name}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, name)  # the reason first: once the traceback is there, both are
