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

from scopedlite import _run
from scopedlite._environments import ENV, World
from scopedlite._launchers._start import (
    ForkChild,
    ForkParent,
    fork_workers,
    start_script_workers,
    threads_per_process,
)
from scopedlite._launchers._supervise import RankFailure, Supervisor, WorkerFailedError, _Interrupted, is_consequence
from scopedlite._output import install_rank_prefix
from scopedlite._plan import Machine, Plan, resolve
from scopedlite._run import Run
from scopedlite._scope import Scope, ScopeError
from scopedlite._stacks import CollectiveTimeoutError, collect_stacks, enable_stack_dumps, looks_like_timeout, stack_file
from scopedlite._stop import StopSignals
from scopedlite._strategies._base import Rendezvous

__all__ = ["launch"]

# Whether this process already started a multi-process block (script or fork). A worker
# re-executing the script would run that block again, so a later block must fork. (Process
# state by nature: it describes this interpreter's history, not a scope.)
_script_launched = [False]

# How many launch blocks this process entered at each file:line. A launch is identified by
# its site *and* this count ("x.py:3#2"), so a helper holding one `with lite.launch(...)`
# called twice (`run(1); run(2)`) gives two launches a worker can tell apart.
_entered_at: dict[str, int] = {}

# How much longer than rank 0 a worker waits at the end of the block (see _final_barrier).
_WORKER_GRACE_S = 5.0

# What our launcher puts in a worker's environment (scopedlite._launchers._start), except
# OMP_NUM_THREADS, which is the program's to keep.
_WORKER_VARIABLES = (
    ENV.TOKEN, ENV.SITE, ENV.ERROR_FILE, ENV.PARENT_PID, "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
)


class _Launch(Scope[Run]):
    _var = _run.launch_var

    def __init__(self, arguments: dict[str, Any], site: str) -> None:
        self._arguments = arguments
        self._site = site
        self.run: Run
        self._role = "none"  # none | parent | worker | external
        self._supervisor: Supervisor | None = None
        self._store: Any = None
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
        _entered_at[self._site] = _entered_at.get(self._site, 0) + 1
        self._identity = f"{self._site}#{_entered_at[self._site]}"
        env: dict[str, str] = dict(os.environ)
        # A worker of ours is the main process's own child. A process that only inherited a
        # worker's variables (a script that rank 1 started) is not one.
        is_worker = ENV.TOKEN in env and env.get(ENV.PARENT_PID) == str(os.getppid())
        if ENV.TOKEN in env and (not is_worker or env.get(ENV.SITE) != self._identity):
            # A worker of ours passing a launch before the one that started it: the parent
            # ran that block as one process, so the worker does the same.
            env = {k: v for k, v in env.items() if k not in _WORKER_VARIABLES}
        plan = resolve(
            **self._arguments,
            env=env,
            machine=Machine.probe(launched_before=_script_launched[0]),
        )
        self.plan = plan
        if is_worker and ENV.TOKEN not in env and plan.world_size > 1:
            raise RuntimeError(
                f"This worker was started by the launch at {_describe_identity(os.environ.get(ENV.SITE, ''))} but "
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
            self._error_file = os.environ.get(ENV.ERROR_FILE)
            self._become_worker(plan)
            # What we handed this worker is ours, not the program's: rank 0 never had it in
            # its environment, and a process this rank starts (a script that launches a run
            # of its own) must not inherit it.
            for key in _WORKER_VARIABLES:
                os.environ.pop(key, None)
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
        self.run = Run(
            global_rank=world.global_rank,
            local_rank=world.local_rank,
            node_rank=world.node_rank,
            world_size=world.world_size,
            local_world_size=world.local_world_size,
            device=device,
            precision=plan.precision,
            accelerator=accelerator,
            strategy=strategy,
            timeout=plan.timeout,
        )
        try:
            strategy.start(self.run, rendezvous)
        except BaseException:
            _stop_quietly(strategy)  # a strategy failing halfway must not leak its group
            raise
        supervisor = self._supervisor
        self._stop_signals = StopSignals(supervisor.signal_all if supervisor else None).install()
        if self._role == "worker":
            self._enable_stack_dumps(world.global_rank)
        return self.run

    def _enable_stack_dumps(self, rank: int) -> None:
        folder = self._error_dir or Path(getattr(self, "_error_file", None) or "").parent
        if str(folder) not in ("", "."):
            enable_stack_dumps(stack_file(Path(folder), rank))

    def _share_cores(self, plan: Plan, local_world_size: int) -> None:
        """Give each of N local processes max(1, C // N) torch threads, as Fabric does,
        unless the user (or torchrun) set OMP_NUM_THREADS."""
        if "OMP_NUM_THREADS" not in os.environ and plan.accelerator == "cpu" and local_world_size > 1:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(threads_per_process(Machine.probe().cpu_count, local_world_size))

    def _become_worker(self, plan: Plan) -> None:
        from scopedlite._launchers._supervise import set_parent_death_signal

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
                store = self._store = self._create_store(plan)
                forked.send_port(store.port)
                workers: list[Any] = forked.workers
                _script_launched[0] = True
            else:
                store = self._store = self._create_store(plan)
                workers = start_script_workers(
                    n, store.port, secrets.token_hex(8), self._identity, self._error_dir, threads
                )
                _script_launched[0] = True
            self._supervisor = Supervisor(workers, self._error_dir)
            self._supervisor.start()
            self._wait_for_workers(store, n)
            world = World("scopedlite", 0, 0, 0, n, n, "127.0.0.1", store.port)
            return self._start_here(plan, world, Rendezvous(world, store))
        except _Interrupted:
            failures = self._supervisor.failures() if self._supervisor else []
            self._cleanup_parent()
            raise WorkerFailedError(failures) from None
        except BaseException:
            self._cleanup_parent()
            raise

    def _wait_for_workers(self, store: Any, n: int) -> None:
        """Wait, in Python, until every worker reached the store, or one exited or failed.

        A worker that exits before it reaches this launch, even with code 0 (its copy of the
        script took another path), can never arrive: it is reported at once, with its exit
        code. The limit is the start-up one (``SCOPEDLITE_START_TIMEOUT``), not
        ``launch(timeout=)``, which bounds collectives.
        """
        from scopedlite._distributed import START_TIMEOUT_ENV, ready_key, start_timeout

        supervisor = self._supervisor
        assert supervisor is not None
        seconds = start_timeout().total_seconds()
        pending = {rank: ready_key(rank) for rank in range(1, n)}
        deadline = time.monotonic() + seconds
        while pending:
            for rank, key in list(pending.items()):
                if store.check([key]):
                    del pending[rank]
            failures = supervisor.failures()
            if failures:
                raise WorkerFailedError(failures)
            gone = [(w.rank, w.poll()) for w in supervisor.workers if w.rank in pending and w.poll() is not None]
            if gone:
                raise WorkerFailedError([
                    RankFailure(rank, code, None, f"exited with code {code} before it reached {self.describe()}"
                                + (" (did its run of the script take another path?)" if code == 0 else "")
                                + "; its output, if any, is above")
                    for rank, code in gone
                ])
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank(s) {sorted(pending)} did not reach {self.describe()} within "
                    f"{seconds:.0f} s of being started. That start-up limit is "
                    f"{START_TIMEOUT_ENV} (seconds, default 1800); launch(timeout=) bounds "
                    "collectives only."
                )
            time.sleep(0.01)

    def _create_store(self, plan: Plan) -> Any:
        """Rank 0's rendezvous store, listening on 127.0.0.1 only.

        Every rank of a run we start is on this machine, so no other host has any business
        with the store. torch's ``TCPStore`` binds every interface when it opens the port
        itself; handed a socket already bound to the loopback address, it listens there.
        """
        import socket

        import torch.distributed as dist

        from scopedlite._distributed import start_timeout

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = listener.getsockname()[1]
        except BaseException:
            listener.close()
            raise
        return dist.TCPStore(
            "127.0.0.1",
            port,
            plan.world_size,
            is_master=True,
            timeout=max(plan.timeout, start_timeout()),  # collectives are bounded by the group
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns (and closes) it from here
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
            if isinstance(exc, SystemExit) and exc.code is None:
                code = 0
            if code:
                self._write_traceback(exc)
            elif self.run.world_size > 1:
                # sys.exit(0) inside the block, on this rank alone as far as it knows: the
                # others would wait for it in their next collective. Say so; rank 0 reports it
                # (unless it is leaving the same way, and then nobody is left to care).
                where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
                at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
                self._write_traceback(
                    exc,
                    f"left the launch block early: SystemExit({exc.code!r}){at}, while the other "
                    "ranks were still in it",
                )
        try:
            self.run.strategy.stop()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Leave now: the code after the block is the main process's alone, and a
            # SystemExit could be caught by the user's own try/except around the block.
            os._exit(code)

    def _write_traceback(self, exc: BaseException, reason: str | None = None) -> None:
        """Hand rank 0 this worker's traceback, and one line saying what happened.

        The line is the exception's own first line (``raised ValueError: bad batch``), not
        the traceback's last one, which may be a continuation of a multi-line message (a
        pytest assertion's ``+  where ...``).
        """
        path = getattr(self, "_error_file", None) or os.environ.get(ENV.ERROR_FILE)
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

    def _final_barrier(self) -> None:
        """Every rank reached the end of the block before any leaves it.

        In a run we started, the ranks meet through the store (see
        :func:`scopedlite._distributed.end_of_block_barrier`); a worker waits a little longer
        than rank 0, so that when one rank skipped a collective the others are in, rank 0
        times out first and reports where everyone was. With ``SCOPEDLITE_DEBUG=1`` the end of
        the block is checked like any collective of ours, so a rank still in a collective is
        named at once.
        """
        run = self.run
        if run.world_size <= 1:
            return
        from scopedlite._debug import check_same_collective, debug_enabled
        from scopedlite._distributed import end_of_block_barrier

        if debug_enabled():
            device = getattr(run.strategy, "_comm_device", None) or run.device
            check_same_collective(run.strategy, run.global_rank, device, "the end of the launch block")
        if self._role in ("parent", "worker"):
            seconds = run.timeout.total_seconds() + (0 if self._role == "parent" else _WORKER_GRACE_S)
            if end_of_block_barrier(run.global_rank, run.world_size, seconds):
                return
        run.strategy.barrier()

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
            if raised_in_block and not interrupted and failures and all(map(is_consequence, failures)):
                failures = []  # the workers only followed rank 0's own failure: report that
            # A collective timed out: on rank 0, or first on a worker (the ranks waiting in the
            # same collective time out together). Either way the diagnosis is where every rank
            # was, not one rank's timeout.
            worker_timeouts = bool(failures) and all(f.timed_out for f in failures)
            timed_out = worker_timeouts or (not failures and not interrupted and looks_like_timeout(exc))  # type: ignore[arg-type]
            # Ask the workers where they are before stopping them: that is the diagnosis.
            stacks = {**supervisor.stacks, **collect_stacks(supervisor.workers, supervisor.error_dir)} if timed_out else {}
            supervisor.kill_all()
            _stop_quietly(self.run.strategy)
            if timed_out:
                cause: BaseException = exc  # type: ignore[assignment]
                if worker_timeouts:
                    for failure in failures:  # a rank that timed out: its traceback is its stack
                        stacks.setdefault(failure.rank, failure.traceback or failure.summary())
                    if interrupted or not looks_like_timeout(exc):  # type: ignore[arg-type]
                        cause = TimeoutError(failures[0].summary()).with_traceback(exc.__traceback__)  # type: ignore[union-attr]
                raise CollectiveTimeoutError(cause, stacks, self.run.world_size) from exc  # type: ignore[arg-type]
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
        # Only now that no worker is left to read it (they may still be leaving the final
        # barrier when rank 0 is through) does the store go.
        self._store = None
        forked = getattr(self, "_fork_parent", None)
        if isinstance(forked, ForkParent):
            forked.close()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None
        if self._error_dir is not None:
            shutil.rmtree(self._error_dir, ignore_errors=True)
            self._error_dir = None


def _describe_identity(identity: str) -> str:
    """``x.py:3#2`` -> ``x.py:3 (launch block number 2 entered there)``."""
    site, _, count = identity.rpartition("#")
    if not site or count == "1":
        return site or identity
    return f"{site} (launch block number {count} entered there)"


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
    }
    return _Launch(arguments, site)
