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
"""

from __future__ import annotations

import datetime
import os
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from scopedlite._cluster.environments import ENV, World
from scopedlite._comm.process_group import ready_key
from scopedlite._core import run as _run
from scopedlite._core.run import Placement, Run
from scopedlite._core.scope import Scope, ScopeError
from scopedlite._hardware.machine import Machine
from scopedlite._launch.output import install_rank_prefix
from scopedlite._launch.signals import StopSignals
from scopedlite._launch.stacks import (
    CollectiveTimeoutError,
    collect_stacks,
    enable_stack_dumps,
    looks_like_timeout,
    stack_file,
)
from scopedlite._launch.start import (
    ForkChild,
    ForkParent,
    fork_workers,
    start_script_workers,
    threads_per_process,
)
from scopedlite._launch.supervise import (
    Supervisor,
    WorkerFailedError,
    _Interrupted,
    set_parent_death_signal,
)
from scopedlite._loggers.base import Logger, MetricLog
from scopedlite._plan import Plan, resolve
from scopedlite._strategies.base import Rendezvous

__all__ = ["launch"]

# Whether this process already started a multi-process block (script or fork). A worker
# re-executing the script would run that block again, so a later block must fork. (Process
# state by nature: it describes this interpreter's history, not a scope.)
_script_launched = [False]


class _Launch(Scope[Run]):
    _var = _run.launch_var

    def __init__(self, arguments: dict[str, Any], site: str) -> None:
        self._arguments = arguments
        self._site = site
        self.run: Run
        self._role = "none"  # none | parent | worker | external
        self._supervisor: Supervisor | None = None
        self._error_dir: Path | None = None
        self._threads: int | None = None

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._arguments.items() if v not in ("auto", None))
        return f"lite.launch({shown}) at {self._site}"

    # -- enter -------------------------------------------------------------------------------
    def _enter(self) -> Run:
        if _run.launch_var.get() is not None:
            raise ScopeError(
                f"{self.describe()} is inside another open launch "
                f"({_run.launch_var.get().describe()}); launch blocks do not nest. Close the "
                "first block before starting the next."
            )
        env: dict[str, str] = dict(os.environ)
        if ENV.TOKEN in env and env.get(ENV.SITE) != self._site:
            # A worker of ours passing a launch before the one that started it: the parent
            # ran that block as one process, so the worker does the same.
            env = {k: v for k, v in env.items() if k != ENV.TOKEN}
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
                env.pop(key, None)
        plan = resolve(
            **self._arguments,
            env=env,
            machine=Machine.probe(launched_before=_script_launched[0]),
        )
        self.plan = plan
        if ENV.TOKEN in os.environ and ENV.TOKEN not in env and plan.world_size > 1:
            raise RuntimeError(
                f"This worker was started by the launch at {os.environ.get(ENV.SITE)} but "
                f"reached {self.describe()} first, a multi-process block the main process did "
                "not start workers for. Every multi-process launch block must come after the "
                "first one in the script, or live in its own script."
            )
        if plan.launcher == "none":
            return self._start_here(plan, World("local", 0, 0, 0, 1, 1, "127.0.0.1", 0), None)
        if plan.launcher == "join":
            assert plan.world is not None
            if plan.world.source != "scopedlite":
                self._role = "external"
                self._share_cores(plan, plan.world.local_world_size)
                return self._start_here(plan, plan.world, Rendezvous(plan.world))
            self._role = "worker"
            self._become_worker(plan)
            install_rank_prefix(plan.world.global_rank)
            try:
                return self._start_here(plan, plan.world, Rendezvous(plan.world))
            except BaseException as e:  # report it to rank 0 like any failure in the block
                self._write_traceback(e)
                os._exit(1)
        return self._start_world(plan)

    def _start_here(self, plan: Plan, world: World, rendezvous: Rendezvous | None) -> Run:
        accelerator = plan.accelerator
        if accelerator == "cpu":
            device = torch.device("cpu")
        elif accelerator == "mps":
            device = torch.device("mps")
        else:
            device = torch.device(accelerator, plan.devices[world.local_rank])
        strategy = plan.strategy.fresh()
        placement = Placement(
            global_rank=world.global_rank,
            local_rank=world.local_rank,
            node_rank=world.node_rank,
            world_size=world.world_size,
            local_world_size=world.local_world_size,
            device=device,
            precision=plan.precision,
            accelerator=accelerator,
            timeout=plan.timeout,
        )
        self.run = Run.of(placement, strategy)
        self.metrics = MetricLog(plan.loggers, write=placement.is_global_zero)  # lite.log's record
        try:
            strategy.start(placement, rendezvous)
        except BaseException:
            _stop_quietly(strategy)  # a strategy failing halfway must not leak its group
            raise
        supervisor = self._supervisor
        self._stop_signals = StopSignals(supervisor.signal_all if supervisor else None).install()
        if self._role == "worker":
            self._enable_stack_dumps(world.global_rank)
        return self.run

    def _enable_stack_dumps(self, rank: int) -> None:
        folder = self._error_dir or Path(os.environ.get(ENV.ERROR_FILE, "")).parent
        if str(folder) not in ("", "."):
            enable_stack_dumps(stack_file(Path(folder), rank))

    def _share_cores(self, plan: Plan, local_world_size: int) -> None:
        """Give each of N local processes max(1, C // N) torch threads, as Fabric does,
        unless the user (or torchrun) set OMP_NUM_THREADS."""
        if "OMP_NUM_THREADS" not in os.environ and plan.accelerator == "cpu" and local_world_size > 1:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(threads_per_process(Machine.probe().cpu_count, local_world_size))

    def _become_worker(self, plan: Plan) -> None:
        parent = os.environ.get(ENV.PARENT_PID)
        set_parent_death_signal(int(parent) if parent else None)

    def _start_world(self, plan: Plan) -> Run:
        """Rank 0 of a world we start: workers first, then our own process group."""
        n = plan.local_world_size
        self._role = "parent"
        self._error_dir = Path(tempfile.mkdtemp(prefix="scopedlite-"))
        cpu_count = Machine.probe().cpu_count
        threads = threads_per_process(cpu_count, n)
        if "OMP_NUM_THREADS" not in os.environ and plan.accelerator == "cpu":
            self._threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            if plan.launcher == "fork":
                forked = fork_workers(n)
                if isinstance(forked, ForkChild):
                    return self._start_forked_child(plan, forked, threads)
                self._fork_parent = forked
                store = self._create_store(plan)
                forked.send_port(store.port)
                workers: list[Any] = forked.workers
                _script_launched[0] = True
            else:
                store = self._create_store(plan)
                workers = start_script_workers(
                    n, store.port, secrets.token_hex(8), self._site, self._error_dir, threads
                )
                _script_launched[0] = True
            self._supervisor = Supervisor(workers, self._error_dir)
            self._supervisor.start()
            self._wait_for_workers(store, n, plan.timeout.total_seconds())
            world = World("scopedlite", 0, 0, 0, n, n, "127.0.0.1", store.port)
            return self._start_here(plan, world, Rendezvous(world, store))
        except _Interrupted:
            failures = self._supervisor.failures() if self._supervisor else []
            self._cleanup_parent()
            raise WorkerFailedError(failures) from None
        except BaseException:
            self._cleanup_parent()
            raise

    def _wait_for_workers(self, store: Any, n: int, seconds: float) -> None:
        """Wait, in Python, until every worker reached the store (or one failed)."""
        assert self._supervisor is not None
        keys = [ready_key(rank) for rank in range(1, n)]
        deadline = time.monotonic() + seconds
        while not store.check(keys):
            failures = self._supervisor.failures()
            if failures:
                raise WorkerFailedError(failures)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The workers did not reach lite.launch within {seconds:.0f} s (timeout=)."
                )
            time.sleep(0.01)

    def _create_store(self, plan: Plan) -> Any:
        return dist.TCPStore(
            "127.0.0.1",
            0,
            plan.world_size,
            is_master=True,
            timeout=plan.timeout,
            wait_for_workers=False,
        )

    def _start_forked_child(self, plan: Plan, child: ForkChild, threads: int) -> Run:
        try:
            return self._join_as_forked_child(plan, child, threads)
        except BaseException as e:
            self._write_traceback(e)
            os._exit(1)

    def _join_as_forked_child(self, plan: Plan, child: ForkChild, threads: int) -> Run:
        self._role = "worker"
        self._supervisor = None
        assert self._error_dir is not None
        self._error_file = self._error_dir / f"rank{child.local_rank}.txt"
        if "OMP_NUM_THREADS" not in os.environ and plan.accelerator == "cpu":
            torch.set_num_threads(threads)
        port = child.read_port()
        n = plan.local_world_size
        world = World("scopedlite", child.local_rank, child.local_rank, 0, n, n, "127.0.0.1", port)
        install_rank_prefix(child.local_rank)
        return self._start_here(plan, world, Rendezvous(world))

    # -- exit --------------------------------------------------------------------------------
    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        stop_signals = getattr(self, "_stop_signals", None)
        if stop_signals is not None:
            stop_signals.uninstall()
        self.metrics.finish(failed=exc is not None)  # flush the run's loggers, whatever happens next
        if self._role == "worker":
            self._exit_worker(exc)  # never returns
        if self._role == "parent":
            return self._exit_parent(exc)
        try:
            if exc is None and self._role == "external":
                self._final_barrier()  # every rank done before the process group goes
            self.run.strategy.stop()
        finally:
            if self._threads is not None:  # an external world's process shared the cores
                torch.set_num_threads(self._threads)
                self._threads = None
        return None

    def _exit_worker(self, exc: BaseException | None) -> None:
        code = 0
        if exc is None:
            try:
                self._final_barrier()
            except BaseException as e:  # a peer failed while we were finishing
                exc, code = e, 1
        if exc is not None:
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
            if code:
                self._write_traceback(exc)
        try:
            self.run.strategy.stop()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Leave now: the code after the block is the main process's alone, and a
            # SystemExit could be caught by the user's own try/except around the block.
            os._exit(code)

    def _write_traceback(self, exc: BaseException) -> None:
        path = getattr(self, "_error_file", None) or os.environ.get(ENV.ERROR_FILE)
        if not path:
            traceback.print_exception(exc)
            return
        text = "".join(traceback.format_exception(exc))
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def _final_barrier(self) -> None:
        if self.run.world_size > 1:
            self.run.strategy.barrier()

    def _exit_parent(self, exc: BaseException | None) -> bool | None:
        supervisor = self._supervisor
        assert supervisor is not None
        supervisor.disarm()
        raised_in_block = exc is not None
        try:
            if exc is None:
                try:
                    self._final_barrier()
                    self.run.strategy.stop()
                except BaseException as e:  # a worker failed while rank 0 was finishing
                    exc = e
                else:
                    failures = supervisor.wait_all(self.plan.timeout.total_seconds())
                    if failures:
                        raise WorkerFailedError(failures)
                    return None
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and raised_in_block:
                # Ctrl-C or a second SIGTERM: the user stops the run; workers failing now
                # only follow the signal we forwarded to them.
                supervisor.kill_all()
                _stop_quietly(self.run.strategy)
                return None
            # Something went wrong. If a worker failed, that is the cause to report.
            interrupted = isinstance(exc, _Interrupted)
            failures = supervisor.wait_for_failure(0.0 if interrupted else 0.5)
            timed_out = not failures and not interrupted and looks_like_timeout(exc)  # type: ignore[arg-type]
            # Ask the workers where they are before stopping them: that is the diagnosis.
            stacks = collect_stacks(supervisor.workers, supervisor.error_dir) if timed_out else {}
            supervisor.kill_all()
            _stop_quietly(self.run.strategy)
            if timed_out:
                raise CollectiveTimeoutError(exc, stacks, self.run.world_size) from exc  # type: ignore[arg-type]
            if failures or interrupted:
                raise WorkerFailedError(failures or supervisor.failures()) from (
                    None if interrupted else exc
                )
            if hasattr(exc, "add_note") and self.run.world_size > 1:
                exc.add_note(  # type: ignore[union-attr]
                    f"[scopedlite] raised on rank 0 of {self.run.world_size}; the other ranks "
                    "were stopped."
                )
            if raised_in_block:
                return None  # let the block's own exception propagate untouched
            raise exc  # type: ignore[misc]
        finally:
            self._cleanup_parent()

    def _cleanup_parent(self) -> None:
        if self._supervisor is not None:
            self._supervisor.kill_all()
            self._supervisor.reap()
            self._supervisor.close()
            self._supervisor = None
        forked = getattr(self, "_fork_parent", None)
        if isinstance(forked, ForkParent):
            forked.close()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None
        if self._error_dir is not None:
            shutil.rmtree(self._error_dir, ignore_errors=True)
            self._error_dir = None


def _stop_quietly(strategy: Any) -> None:
    try:
        strategy.stop()
    except Exception:  # the run failed already; its first error is the one to report
        pass


def launch(
    accelerator: str = "auto",
    strategy: Any = "auto",
    devices: Any = "auto",
    num_nodes: int | None = None,
    precision: str = "32-true",
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
            ``"16-true"`` or ``"bf16-true"``.
        launcher: ``"auto"``, ``"script"`` (re-execute the command line) or ``"fork"``.
        timeout: Seconds (or a timedelta) a collective waits for the other ranks before it
            fails; default 30 minutes.
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
