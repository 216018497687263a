"""``lite.launch``: the parallel region.

Entering resolves the arguments into a :class:`~scopedlite._plan.Plan` and then, by its
launcher:

- ``none``: one process; the block runs here.
- ``script``: this process becomes rank 0 and re-executes its command line once per other
  local rank. A re-executed worker reaching this same ``launch`` joins the run (``join``) and
  leaves the process at the end of the block, so code after it runs once, here.
- ``fork``: like ``script``, but the workers are forked at ``__enter__`` and run the body of
  the block themselves (notebooks, REPLs, later blocks of a script).
- ``join``: the world exists already (torchrun, or a worker of ours): spawn nothing, join.

Each way of taking part is one role object (``role.py``, ``worker.py``, ``parent.py``); the
scope picks the role and hands ``__enter__``/``__exit__`` to it.
"""

from __future__ import annotations

import datetime
import os
import sys
from types import TracebackType
from typing import Any

from scopedlite._cluster.environments import ENV
from scopedlite._core import run as _run
from scopedlite._core.process import describe_identity, this_process
from scopedlite._core.run import Run
from scopedlite._core.scope import Scope, ScopeError
from scopedlite._hardware.machine import Machine
from scopedlite._io.background import BackgroundSaves
from scopedlite._io.files import CheckpointError
from scopedlite._launch.parent import Parent
from scopedlite._launch.role import External, Role, Solo
from scopedlite._launch.worker import WORKER_VARIABLES, Worker
from scopedlite._loggers.base import Logger, MetricLog
from scopedlite._plan import Plan, resolve

__all__ = ["launch"]


class _Launch(Scope[Run]):
    _var = _run.launch_var

    def __init__(self, arguments: dict[str, Any], site: str) -> None:
        self._arguments = arguments
        self._site = site
        self.role: Role | None = None
        self.metrics = MetricLog((), write=False)  # lite.log's record, made once the run is placed
        self.saves = BackgroundSaves()  # lite.save(..., blocking=False)'s write in flight

    @property
    def run(self) -> Run:
        """The run of the open block (what ``lite.current()`` returns inside it)."""
        assert self.role is not None and self.role.run is not None, "the launch block is not open"
        return self.role.run

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._arguments.items() if v not in ("auto", None))
        return f"lite.launch({shown}) at {self._site}"

    def _enter(self) -> Run:
        if _run.launch_var.get() is not None:
            raise ScopeError(
                f"{self.describe()} is inside another open launch "
                f"({_run.launch_var.get().describe()}); launch blocks do not nest. Close the "
                "first block before starting the next."
            )
        identity = this_process.enter(self._site)
        env: dict[str, str] = dict(os.environ)
        # A worker of ours is the main process's own child. A process that only inherited a
        # worker's variables (a script that rank 1 started) is not one.
        is_worker = ENV.TOKEN in env and env.get(ENV.PARENT_PID) == str(os.getppid())
        if ENV.TOKEN in env and (not is_worker or env.get(ENV.SITE) != identity):
            # A worker of ours passing a launch before the one that started it: the parent
            # ran that block as one process, so the worker does the same.
            env = {k: v for k, v in env.items() if k not in WORKER_VARIABLES}
        plan = resolve(**self._arguments, env=env, machine=Machine.probe(launched_before=this_process.launched))
        if is_worker and ENV.TOKEN not in env and plan.world_size > 1:
            raise RuntimeError(
                f"This worker was started by the launch at "
                f"{describe_identity(os.environ.get(ENV.SITE, ''))} but reached "
                f"{self.describe()} first, a multi-process block the main process did not start "
                "workers for. Every multi-process launch block must come after the first one in "
                "the script, or live in its own script."
            )
        self.role = self._role_for(plan, identity)
        run = self.role.enter()
        self.metrics = MetricLog(plan.loggers, write=run.is_global_zero)
        _run.launches.add(self)  # threads started in the block find the run (_core/run.py)
        self.role.body_begins()  # last: a worker's failure interrupts what `_exit` reports
        return run

    def _role_for(self, plan: Plan, identity: str) -> Role:
        if plan.launcher == "none":
            return Solo(plan)
        if plan.launcher == "join":
            assert plan.world is not None
            return Worker.re_executed(plan) if plan.world.is_ours else External(plan)
        return Parent(plan, identity, self.describe()).spawn()

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        failed_save, exc = self._finish_saves(exc)
        try:
            assert self.role is not None
            self.role.quiet()
        except BaseException as late:  # noqa: BLE001 - a worker's failure interrupted us as the block ended
            exc = exc if exc is not None else late
        _run.launches.remove(self)
        self.metrics.finish(failed=exc is not None or failed_save is not None)  # flush the run's loggers
        suppress = self.role.exit(exc)  # a worker of ours leaves the process here
        if failed_save is not None and exc is None:
            raise failed_save  # after the run ended cleanly: every rank agreed on it
        return suppress

    def _finish_saves(self, exc: BaseException | None) -> tuple[CheckpointError | None, BaseException | None]:
        """Wait for a ``lite.save(..., blocking=False)`` still being written; return a failed
        write and the block's exception.

        After a normal end the ranks wait together: a write that failed is known to every
        rank alike, so the run still ends cleanly and the ``with`` statement raises it (on
        rank 0, which runs the code after the block; our workers leave as usual). After an
        exception each rank waits for its own part, and a failure is added to the block's
        exception as a note. What interrupts the wait (Ctrl-C, a peer gone) is the block's
        exception.
        """
        try:
            error = self.saves.close(every_rank=exc is None)
        except CheckpointError as agreed:
            return agreed, exc
        except BaseException as e:  # noqa: BLE001 - reported by the role, as the block's own
            return None, exc if exc is not None else e
        if error is not None and exc is not None and hasattr(exc, "add_note"):
            exc.add_note(f"[scopedlite] a save in the background failed as well: {type(error).__name__}: {error}")
        return None, exc


def launch(
    accelerator: str = "auto",
    strategy: Any = "auto",
    devices: Any = "auto",
    num_nodes: int | None = None,
    precision: str | int = "32-true",
    launcher: str = "auto",
    timeout: float | datetime.timedelta | None = None,
    loggers: Logger | list[Logger] | None = None,
) -> _Launch:
    """Open the parallel region: ``with lite.launch(...) as run:``.

    Args:
        accelerator: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"gpu"`` (CUDA or MPS), ``"mps"``, or
            ``"tpu"``/``"xla"`` (needs ``scopedlite[xla]``; never chosen by ``"auto"``).
        strategy: A name (``"auto"``, ``"single"``, ``"ddp"``, ``"ddp_fork"``, ...) or a
            configured instance such as ``lite.DDPStrategy(find_unused_parameters=True)``.
        devices: ``"auto"``, a number of devices (processes on CPU), or CUDA indices.
        num_nodes: Number of nodes; None takes it from torchrun/SLURM/MPI (1 outside them).
        precision: ``"32-true"``, ``"64-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"`` or ``"bf16-true"``; Fabric's short spellings mean what they
            mean there (``16``/``"16"``: ``"16-mixed"``, ``"bf16"``: ``"bf16-mixed"``,
            ``32``/``"32"``: ``"32-true"``, ``64``/``"64"``: ``"64-true"``).
        launcher: ``"auto"``, ``"script"`` (re-execute the command line) or ``"fork"``.
        timeout: Seconds (or a timedelta) a collective waits for the other ranks before it
            fails; default 30 minutes. A run whose ranks all wait for each other with
            nothing moving ends sooner, after ``SCOPEDLITE_HANG_TIMEOUT`` seconds (120).
        loggers: Where ``lite.log``/``lite.log_dict`` write, on global rank 0: a logger
            (``lite.CSVLogger``, ``lite.TensorBoardLogger``, any ``lite.Logger``) or a list;
            flushed and closed when the block ends, successfully or not.

    Returns:
        A scope object; entering it yields the :class:`~scopedlite.Run` of this process.
        Each object is good for one ``with`` block. Inside the block, code runs on every
        rank; after it, once, in the main process (under torchrun, on every process).

    Raises:
        ValueError, TypeError: An invalid argument or combination, before anything starts.
        WorkerFailedError: A rank failed; the message names it and carries its traceback.
    """
    frame = sys._getframe(1)
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    arguments = {
        "accelerator": accelerator,
        "strategy": strategy,
        "devices": devices,
        "num_nodes": num_nodes,
        "precision": precision,
        "launcher": launcher,
        "timeout": timeout,
        "loggers": loggers,
    }
    return _Launch(arguments, site)
