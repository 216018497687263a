"""Rank 0 of a world we start: it hosts the store, starts and supervises the other local
ranks, and turns any failure into one error that names the ranks.

The workers are started first (re-executed scripts, or forked children that run the body
of the block themselves), then rank 0 waits in Python for each to announce itself on the
store, where a worker that died or exited on the way is noticed at once, and only then
creates its own process group.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scopedlite._cluster.environments import World
from scopedlite._comm.distributed import START_TIMEOUT_ENV, ready_key, start_timeout
from scopedlite._core.process import this_process
from scopedlite._core.run import Run
from scopedlite._hardware.machine import Machine
from scopedlite._launch.output import HeldLines, install_rank_prefix
from scopedlite._launch.role import Role, stop_quietly
from scopedlite._launch.signals import stop_requested
from scopedlite._launch.stacks import CollectiveTimeoutError, collect_stacks, looks_like_timeout
from scopedlite._launch.start import ForkChild, ForkParent, fork_workers, start_script_workers, threads_per_process
from scopedlite._launch.supervise import RankFailure, Supervisor, WorkerFailedError, _Interrupted, is_consequence
from scopedlite._launch.worker import Worker
from scopedlite._plan import Plan
from scopedlite._strategies.base import Rendezvous

__all__ = ["Parent"]


class Parent(Role):
    """Rank 0 of a world we start (``launcher`` ``"script"`` or ``"fork"``).

    Args:
        plan: The launch's plan.
        identity: The launch's identity (site and entry count) that re-executed workers
            match to join this block.
        described: The launch as error messages show it.
    """

    def __init__(self, plan: Plan, identity: str, described: str) -> None:
        super().__init__(plan)
        self.identity = identity
        self.described = described
        self.error_dir: Path | None = None
        self.supervisor: Supervisor | None = None
        self.store: Any = None
        self.forked: ForkParent | None = None
        self.lines: HeldLines | None = None  # rank 0's own output, whole lines for the block

    def spawn(self) -> Role:
        """Start the other local ranks. Returns this role, or, in a forked child, the
        :class:`Worker` role that child plays from here on."""
        n = self.plan.local_world_size
        self.error_dir = Path(tempfile.mkdtemp(prefix="scopedlite-"))
        threads = threads_per_process(Machine.probe().cpu_count, n)
        self.cores.share(self.plan, n, threads)
        try:
            if self.plan.launcher == "fork":
                forked = fork_workers(n)
                if isinstance(forked, ForkChild):
                    return Worker.forked(self.plan, forked, self.error_dir, threads)
                self.forked = forked
                self.store = _loopback_store(self.plan)
                forked.send_port(self.store.port)
                workers: list[Any] = forked.workers
            else:
                self.store = _loopback_store(self.plan)
                workers = start_script_workers(
                    n, self.store.port, secrets.token_hex(8), self.identity, self.error_dir, threads
                )
            this_process.launched = True
            self.supervisor = Supervisor(workers, self.error_dir)
            self.supervisor.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def enter(self) -> Run:
        assert self.supervisor is not None
        n = self.plan.local_world_size
        self.lines = install_rank_prefix(0)
        supervisor = self.supervisor
        try:
            supervisor.arm()  # a worker failing interrupts the waits for the group
            self._wait_for_workers(n)
            world = World("scopedlite", 0, 0, 0, n, n, "127.0.0.1", self.store.port)
            run = self.start_run(world, Rendezvous(world, self.store), forward=supervisor.signal_all)
            self.start_watchdog(lambda: supervisor.sigterm_seen or stop_requested(), end_run=supervisor.end_stalled)
            supervisor.disarm()  # until the body begins (`body_begins`)
            return run
        except BaseException as exc:
            error = self._failed_to_enter(exc)
            if error is exc:
                raise
            raise error from None

    def _failed_to_enter(self, exc: BaseException) -> BaseException:
        """What to raise when entering failed with ``exc``: a worker's failure, when one failed
        and rank 0 only saw its effect (the interrupt, or gloo's "Connection closed by peer"
        from a peer that was stopped because of it), else ``exc``. Stops everything."""
        supervisor = self.supervisor
        assert supervisor is not None
        try:
            supervisor.disarm()
        except _Interrupted as late:  # the one interrupt came while ``exc`` was being handled
            exc = late
        interrupted = isinstance(exc, _Interrupted)
        failures = supervisor.wait_for_failure(0.0 if interrupted else 0.5)
        supervisor.kill_all()
        if self.run is not None:  # the group was made: leave it (not waiting for the others)
            stop_quietly(self.run.strategy)
        self.cleanup()
        own = RankFailure(0, None, "".join(traceback.format_exception(exc)))
        if failures and (interrupted or is_consequence(own)):
            return WorkerFailedError(failures)
        return exc

    def body_begins(self) -> None:
        if self.supervisor is not None:
            self.supervisor.arm()

    def _wait_for_workers(self, n: int) -> None:
        """Wait, in Python, until every worker reached the store, or one exited or failed.

        A worker that exits before it reaches this launch, even with code 0 (its copy of the
        script took another path), can never arrive: it is reported at once, with its exit
        code. The limit is the start-up one (``SCOPEDLITE_START_TIMEOUT``), not
        ``launch(timeout=)``, which bounds collectives.
        """
        supervisor = self.supervisor
        assert supervisor is not None
        seconds = start_timeout().total_seconds()
        pending = {rank: ready_key(rank) for rank in range(1, n)}
        deadline = time.monotonic() + seconds
        while pending:
            for rank, key in list(pending.items()):
                if self.store.check([key]):
                    del pending[rank]
            failures = supervisor.failures()
            if failures:
                raise WorkerFailedError(failures)
            gone = [(w.rank, w.poll()) for w in supervisor.workers if w.rank in pending and w.poll() is not None]
            if gone:
                raise WorkerFailedError(
                    [
                        RankFailure(
                            rank,
                            code,
                            None,
                            f"exited with code {code} before it reached {self.described}"
                            + (" (did its run of the script take another path?)" if code == 0 else "")
                            + "; its output, if any, is above",
                        )
                        for rank, code in gone
                    ]
                )
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank(s) {sorted(pending)} did not reach {self.described} within "
                    f"{seconds:.0f} s of being started. That start-up limit is "
                    f"{START_TIMEOUT_ENV} (seconds, default 1800); launch(timeout=) bounds "
                    "collectives only."
                )
            time.sleep(0.01)

    def quiet(self) -> None:
        if self.supervisor is not None:
            self.supervisor.disarm()

    def exit(self, exc: BaseException | None) -> bool | None:
        # SIGTERM stays a stop request (and the watchdog on) through the end-of-block barrier:
        # a rank that skipped a collective waits there, and a SIGTERM must not kill it silently.
        supervisor, run = self.supervisor, self.run
        assert supervisor is not None and run is not None
        supervisor.disarm()
        raised_in_block = exc is not None
        try:
            if exc is None:
                try:
                    # The supervisor no longer interrupts this thread, and a worker that
                    # failed never reaches the end of the block: stop waiting for it.
                    self.final_barrier(run.timeout.total_seconds(), check=supervisor.raise_if_failed)
                    self.end_watchdog()
                    self.end_signals()
                    run.strategy.stop()
                except BaseException as e:  # noqa: BLE001 - a worker failed while rank 0 was finishing
                    exc = e
                else:
                    failures = supervisor.wait_all(self.plan.timeout.total_seconds())
                    if failures:
                        raise WorkerFailedError(failures)
                    return None
            self.end_watchdog()  # a stall it found is reported below
            self.end_signals()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and raised_in_block:
                # Ctrl-C or a second SIGTERM: the user stops the run; workers failing now
                # only follow the signal we forwarded to them.
                supervisor.kill_all()
                stop_quietly(run.strategy)
                return None
            return self._report(exc, raised_in_block)
        finally:
            self.cleanup()

    def _report(self, exc: BaseException, raised_in_block: bool) -> bool | None:
        """Something went wrong: if a worker failed, that is the cause to report."""
        supervisor, run = self.supervisor, self.run
        assert supervisor is not None and run is not None
        if supervisor.stall is not None:
            # The hang watchdog found every rank waiting for the others and stopped the
            # workers (which is why rank 0's collective failed): its diagnosis is the error.
            diagnosis, stacks = supervisor.stall, dict(supervisor.stacks)
            supervisor.kill_all()
            stop_quietly(run.strategy)
            raise CollectiveTimeoutError(
                exc, stacks, run.world_size, headline=diagnosis.text(), rank0_stack=diagnosis.stack
            ) from exc
        interrupted = isinstance(exc, _Interrupted)
        failures = supervisor.wait_for_failure(0.0 if interrupted else 0.5)
        if raised_in_block and not interrupted and failures and all(map(is_consequence, failures)):
            failures = []  # the workers only followed rank 0's own failure: report that
        # A collective timed out: on rank 0, or first on a worker (the ranks waiting in the
        # same collective time out together). Either way the diagnosis is where every rank
        # was, not one rank's timeout.
        worker_timeouts = bool(failures) and all(f.timed_out for f in failures)
        timed_out = worker_timeouts or (not failures and not interrupted and looks_like_timeout(exc))
        # Ask the workers where they are before stopping them: that is the diagnosis.
        stacks = {**supervisor.stacks, **collect_stacks(supervisor.workers, supervisor.error_dir)} if timed_out else {}
        supervisor.kill_all()
        stop_quietly(run.strategy)
        if timed_out:
            cause: BaseException = exc
            if worker_timeouts:
                for failure in failures:  # a rank that timed out: its traceback is its stack
                    stacks.setdefault(failure.rank, failure.traceback or failure.summary())
                if interrupted or not looks_like_timeout(exc):
                    cause = TimeoutError(failures[0].summary()).with_traceback(exc.__traceback__)
            raise CollectiveTimeoutError(cause, stacks, run.world_size) from exc
        if failures or interrupted:
            raise WorkerFailedError(failures or supervisor.failures()) from (None if interrupted else exc)
        if run.world_size > 1 and hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"[scopedlite] raised on rank 0 of {run.world_size}; the other ranks were stopped.")
        if raised_in_block:
            return None  # let the block's own exception propagate untouched
        raise exc

    def cleanup(self) -> None:
        """Stop every worker and release what rank 0 holds; safe to call more than once."""
        self.end_watchdog()
        self.end_signals()
        if self.supervisor is not None:
            self.supervisor.kill_all()
            self.supervisor.reap()
            self.supervisor.close()
            self.supervisor = None
        # Only now that no worker is left to read it (they may still be leaving the final
        # barrier when rank 0 is through) does the store go.
        self.store = None
        if self.forked is not None:
            self.forked.close()
            self.forked = None
        self.cores.restore()
        if self.lines is not None:
            self.lines.restore()
            self.lines = None
        if self.error_dir is not None:
            shutil.rmtree(self.error_dir, ignore_errors=True)
            self.error_dir = None


def _loopback_store(plan: Plan) -> Any:
    """Rank 0's rendezvous store, listening on 127.0.0.1 only.

    Every rank of a run we start is on this machine, so no other host has any business with
    the store. torch's ``TCPStore`` binds every interface when it opens the port itself;
    handed a socket already bound to the loopback address, it listens there.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        options = {
            "is_master": True,
            "timeout": max(plan.timeout, start_timeout()),  # collectives are bounded by the group
            "wait_for_workers": False,
            "master_listen_fd": listener.fileno(),
        }
        try:
            store = dist.TCPStore("127.0.0.1", port, plan.world_size, **options)
        except NotImplementedError:
            # Older torch (seen with 2.5 and 2.6): the libuv store cannot take a listening
            # socket; the other one can (torch's own use_libuv option).
            store = dist.TCPStore("127.0.0.1", port, plan.world_size, use_libuv=False, **options)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns (and closes) it from here
    return store
