"""Watching worker processes so that one failure ends the whole run, fast and leaving nothing.

The main process (rank 0) starts a :class:`Supervisor` thread that polls its workers every
50 ms. When one exits badly (an exception, a signal such as SIGKILL, or gloo's SIGABRT) the
supervisor kills the others and interrupts the main thread with a signal whose handler
raises, so rank 0 stops even when it is busy computing outside any collective. Ctrl-C reaches
the supervisor through ``signal.set_wakeup_fd``, so the workers are stopped even while the
main thread is blocked inside a C call. Workers die with the main process through
``PR_SET_PDEATHSIG`` (Linux), so killing rank 0 with SIGKILL leaves no orphan either.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from scopedlite._core.scope import Scope
from scopedlite._launch.stacks import collect_stacks, says_timed_out

__all__ = ["RankFailure", "Supervisor", "WorkerFailedError", "is_consequence", "set_parent_death_signal"]

POLL_SECONDS = 0.05
#: How long a failure that only follows another (a peer's "Connection closed") waits for that
#: other's exit before the rest are stopped: a rank killed by a signal closes its sockets a
#: moment before it can be reaped, and one stopped by us is not reported as a cause.
CAUSE_GRACE_SECONDS = 0.3

# The signal used to interrupt the main thread. A real-time signal is unlikely to be in use
# by the program (SIGUSR1 often is: SLURM sends it before preemption).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: its traceback, or the signal or exit code that ended it."""

    rank: int
    exitcode: int | None
    traceback: str | None
    #: What the rank itself said happened, one line ("raised ValueError: bad batch", "left
    #: the launch block early ..."); None when it could not say (killed, died in C code).
    reason: str | None = None

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is not None and self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None

    @property
    def timed_out(self) -> bool:
        """Whether the rank failed because a collective (or the end-of-block wait) timed out."""
        lines = (self.traceback or "").strip().splitlines()
        text = f"{self.reason or ''} {lines[-1] if lines else ''}".lower()
        return says_timed_out(text) or "timeouterror" in text

    def summary(self) -> str:
        if self.reason:
            return f"rank {self.rank} {self.reason}"
        if self.traceback:
            last = self.traceback.strip().splitlines()[-1]
            return f"rank {self.rank} raised {last}"
        if self.signal_name == "SIGABRT":
            return (
                f"rank {self.rank} aborted (SIGABRT); torch.distributed does this on a "
                "collective mismatch (ranks calling different collectives or shapes): see "
                "its stderr above, with where each of its threads was"
            )
        if self.signal_name:
            return f"rank {self.rank} was killed by {self.signal_name}"
        return (
            f"rank {self.rank} exited with code {self.exitcode} without a Python traceback "
            "(it failed before reaching launch, or called os._exit): see its stderr above"
        )


class WorkerFailedError(RuntimeError):
    """One or more ranks of a launched run failed; the others were stopped.

    Attributes:
        failures: One :class:`RankFailure` per failed rank, in rank order.
    """

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = tuple(sorted(failures, key=lambda f: f.rank))
        summary = "; ".join(f.summary() for f in self.failures)
        if not summary.endswith((".", "!", "?")):
            summary += "."
        lines = [summary + " The other ranks were stopped."]
        for failure in self.failures:
            if failure.traceback:
                lines.append(f"\n--- traceback of rank {failure.rank} ---\n{failure.traceback.rstrip()}")
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(f.rank for f in self.failures)


# Where an interrupt waits for the next poll: a scope being entered (its bookkeeping after
# `_enter`, which no `__exit__` would undo) or left (see `Supervisor._on_interrupt`).
_DEFERRING = (Scope.__enter__.__code__, Scope.__exit__.__code__)


class _Interrupted(BaseException):
    """Raised in the main thread when a worker failed (BaseException: `except Exception`
    in user code must not swallow it)."""


class WorkerProcess(Protocol):
    """A worker process as the supervisor watches it (:class:`PopenWorker`,
    :class:`ForkedWorker`); the code that runs inside it is the ``Worker`` role
    (``worker.py``)."""

    rank: int
    pid: int

    def poll(self) -> int | None: ...


def _exited_and_group_ended(pid: int) -> bool:
    """Whether worker ``pid`` has exited; if it has, first kill what is left of its process group.

    A worker leads its own process group; its children (DataLoader workers) stay in it and
    keep its sockets open, so its peers would only notice it is gone when those children give
    up (about 5 s for a DataLoader). Looking without reaping (``WNOWAIT``) keeps the pid, and
    so the group id, from being reused by an unrelated process while we signal it. A caller
    reaps only after True: a worker that dies between this look and a reap would otherwise be
    reaped with its group left running (CI once found a DataLoader worker alive after the run).
    Where ``waitid`` is missing (not Linux), or the pid is no child of ours, this says True and
    ends nothing.
    """
    if not hasattr(os, "waitid"):
        return True
    try:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return False
    except ChildProcessError:
        return True
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return True


class PopenWorker:
    def __init__(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        self.rank, self.process, self.pid = rank, process, process.pid

    def poll(self) -> int | None:
        if self.process.returncode is None and not _exited_and_group_ended(self.pid):
            return None
        return self.process.poll()


class ForkedWorker:
    def __init__(self, rank: int, pid: int) -> None:
        self.rank, self.pid = rank, pid
        self._returncode: int | None = None

    def poll(self) -> int | None:
        if self._returncode is None:
            if not _exited_and_group_ended(self.pid):
                return None
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self._returncode = 0
                return self._returncode
            if pid != 0:
                self._returncode = os.waitstatus_to_exitcode(status)
        return self._returncode


def _kill(worker: WorkerProcess) -> None:
    # Each worker leads its own process group: this also stops its children (data loaders).
    for kill in (os.killpg, os.kill):
        try:
            kill(worker.pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


class Supervisor:
    """Polls workers, stops them all on the first failure, and reports every failed rank."""

    def __init__(self, workers: list[WorkerProcess], error_dir: Path) -> None:
        self.workers = workers
        self.error_dir = error_dir
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._rank_zero_caused = False  # every failed worker only followed this process's failure
        self._killed: set[int] = set()
        self._stop = threading.Event()
        self._armed = False
        self._main_ident = threading.main_thread().ident
        self._in_main = threading.current_thread() is threading.main_thread()
        self._previous_handler: object = None
        self._wakeup_read = self._previous_wakeup = -1
        self._sigterms = 0
        #: Where the live workers were when one failed by a timeout, by rank.
        self.stacks: dict[int, str] = {}
        #: The hang watchdog's diagnosis, once it ended a run whose ranks all stood still.
        self.stall: Any = None
        self._thread = threading.Thread(target=self._watch, name="scopedlite-supervisor", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._in_main:
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)
            read, write = os.pipe()
            os.set_blocking(write, False)
            os.set_blocking(read, False)
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            if previous != -1:  # someone (asyncio, a kernel) listens already: leave theirs
                signal.set_wakeup_fd(previous)
                os.close(read)
                os.close(write)
            else:
                self._wakeup_read, self._wakeup_write = read, write
        self._thread.start()

    def arm(self) -> None:
        """Interrupt the main thread when a worker fails, from now until :meth:`disarm` (or
        the one interrupt): while rank 0 waits for its group, and through the block's body.
        A failure found while disarmed interrupts at once when armed again."""
        self._armed = self._in_main

    def disarm(self) -> None:
        """Stop interrupting the main thread (called first thing when the block exits)."""
        self._armed = False

    def raise_if_failed(self) -> None:
        """Raise what an interrupt raises when a worker has failed: for rank 0's waits once
        disarmed (the end of the block), which a failed worker would never end."""
        if self._failed.is_set() or self._first_bad_exit() is not None:
            raise _Interrupted()

    def close(self) -> None:
        self._armed = False
        self._stop.set()
        self._thread.join()
        if self._in_main:
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler)  # type: ignore[arg-type]
            if self._wakeup_read != -1:
                signal.set_wakeup_fd(-1)
                os.close(self._wakeup_read)
                os.close(self._wakeup_write)

    # -- the watching thread ---------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._wakeup_read != -1:
                self._drain_signals()
            bad = None if self._failed.is_set() else self._first_bad_exit()
            if bad is not None:
                self._failed.set()
                failure = self._failure_of(bad)
                if is_consequence(failure):
                    self._await_cause(CAUSE_GRACE_SECONDS)
                    # still no worker with a cause of its own: rank 0 (this process) is the cause
                    self._rank_zero_caused = all(is_consequence(f) for f in self.failures())
                if failure.timed_out:
                    # A collective timed out there: the ranks still waiting in it, or not, are
                    # the diagnosis (lite.CollectiveTimeoutError). Ask them before they go.
                    self.stacks = collect_stacks(self.workers, self.error_dir)
                self.kill_all()
            if self._failed.is_set() and self._armed:
                # Every poll until the handler raises (and disarms): it lets one pass where
                # raising would be lost, and a failure found while disarmed waits for `arm`.
                signal.pthread_kill(self._main_ident, INTERRUPT_SIGNAL)  # type: ignore[arg-type]
            self._stop.wait(POLL_SECONDS)

    @property
    def sigterm_seen(self) -> bool:
        """Whether this process received a SIGTERM, seen even while the main thread is blocked
        in C code, where Python's own handler cannot run (see ``signal.set_wakeup_fd``)."""
        return self._sigterms > 0

    def end_stalled(self, diagnosis: Any) -> None:
        """The hang watchdog found every rank waiting for the others: ask the workers where
        they are, stop them, and interrupt the main thread, whose collective then fails; the
        launch reports ``diagnosis`` (``Parent._report``). Called from the watchdog's thread."""
        self.stacks = collect_stacks(self.workers, self.error_dir)
        self.stall = diagnosis
        self._failed.set()
        self.kill_all()  # the next poll interrupts the main thread, whose collective then fails

    def _drain_signals(self) -> None:
        try:
            data = os.read(self._wakeup_read, 64)
        except BlockingIOError:
            return
        except OSError:
            return
        # Ctrl-C stops everything; a first SIGTERM only asks for a clean stop (see signals.py,
        # whose handler forwards it to the workers), a second one stops everything.
        self._sigterms += data.count(signal.SIGTERM)
        if signal.SIGINT in data or self._sigterms >= 2:
            self.kill_all()

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        # Not while a scope is being left: the block's own exception (gloo's "Connection reset",
        # when the failed rank's peer noticed first) is already on its way to launch's exit,
        # which reports the failure; raising there would replace it, unreported. Nor while one
        # is being entered, after its `_enter`: no `__exit__` would report it. Still armed, so
        # the next poll interrupts again if the main thread goes on.
        if self._armed and getattr(frame, "f_code", None) not in _DEFERRING:
            if self._rank_zero_caused and sys.exc_info()[1] is not None:
                # The workers only followed this process's own failure (they read the abort
                # of a lite.join it leaves by its exception), which is on its way out now:
                # raising here would replace it. Launch's exit reports it.
                return
            self._armed = False
            raise _Interrupted()

    # -- queries and actions ---------------------------------------------------------------
    def _first_bad_exit(self) -> WorkerProcess | None:
        for worker in self.workers:
            code = worker.poll()
            if worker.pid in self._killed or code is None:
                continue
            # code 0 is a failure too when the rank left its launch block early (sys.exit(0)
            # inside it): it wrote why, and the others can no longer finish the block.
            if code != 0 or self._reason_of(worker.rank) is not None:
                return worker
        return None

    def _failure_of(self, worker: WorkerProcess) -> RankFailure:
        return RankFailure(worker.rank, worker.poll(), self._traceback_of(worker.rank), self._reason_of(worker.rank))

    def _await_cause(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a worker to exit with a failure of its own (not only a
        broken connection), so that ``kill_all`` does not count it among the ranks we stopped."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            exited = [w for w in self.workers if w.poll() is not None and w.pid not in self._killed]
            if any(not is_consequence(self._failure_of(w)) for w in exited):
                return
            if len(exited) == len(self.workers):
                return
            time.sleep(0.005)

    def signal_all(self, signum: int) -> None:
        """Forward a signal (e.g. SIGTERM for a clean stop) to every live worker."""
        for worker in self.workers:
            if worker.poll() is None:
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:
                    continue

    def kill_all(self) -> None:
        with self._lock:
            for worker in self.workers:
                if worker.poll() is None:
                    self._killed.add(worker.pid)
                    _kill(worker)

    def failures(self) -> list[RankFailure]:
        """The ranks that failed on their own (not ones we stopped), with their tracebacks.

        A rank whose only error is a broken connection to a peer failed *because* another
        rank died; it is left out when a rank with a cause of its own is there to report.
        """
        found = []
        for worker in self.workers:
            failure = self._failure_of(worker)
            if failure.traceback is not None or (failure.exitcode not in (None, 0) and worker.pid not in self._killed):
                found.append(failure)
        causes = [f for f in found if not is_consequence(f)]
        return causes or found

    def _traceback_of(self, rank: int) -> str | None:
        path = self.error_dir / f"rank{rank}.txt"
        try:
            return path.read_text()
        except FileNotFoundError:
            return None

    def _reason_of(self, rank: int) -> str | None:
        try:
            return (self.error_dir / f"rank{rank}.txt.reason").read_text().strip() or None
        except FileNotFoundError:
            return None

    def wait_for_failure(self, seconds: float) -> list[RankFailure]:
        """Wait up to ``seconds`` for some worker to fail; return the failures seen."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._failed.is_set() or self._first_bad_exit() is not None:
                break
            if all(w.poll() is not None for w in self.workers):
                break
            time.sleep(0.01)
        found = self.failures()
        if seconds > 0 and found and all(map(is_consequence, found)):
            self._await_cause(CAUSE_GRACE_SECONDS)
            found = self.failures()
        return found

    def wait_all(self, seconds: float) -> list[RankFailure]:
        """Wait for every worker to exit after a successful block (they are finishing too)."""
        deadline = time.monotonic() + seconds
        while any(w.poll() is None for w in self.workers):
            if self._failed.is_set() or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        stragglers = [w.rank for w in self.workers if w.poll() is None]
        failures = self.failures()
        if stragglers and not failures:
            self.kill_all()
            raise TimeoutError(
                f"rank(s) {stragglers} did not finish within {seconds:.0f} s of rank 0 leaving "
                "the launch block; they were stopped. Is a rank still waiting in a collective "
                "the others skipped?"
            )
        self.kill_all()
        return failures

    def reap(self) -> None:
        for worker in self.workers:
            deadline = time.monotonic() + 5
            while worker.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)


_CONSEQUENCES = (
    "PeerLeftJoinError",  # another rank left lite.join by an exception
    "Connection closed by peer",
    "Connection reset by peer",
    "DistNetworkError",
    "Broken pipe",
)


def is_consequence(failure: RankFailure) -> bool:
    """Whether a rank failed only because another one did: a peer went away and broke its
    collective (see :data:`_CONSEQUENCES`)."""
    trace = failure.traceback or ""
    return any(marker in trace for marker in _CONSEQUENCES)


def set_parent_death_signal(expected_parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere).

    Safe to call in a ``preexec_fn`` (after fork, before exec) and in a forked child. If the
    parent already died before the request took effect, exit now.
    """
    libc = _libc()
    if libc is None:
        return
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


_LIBC: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    """libc with prctl, loaded once (before any fork) and cached; None off Linux."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl  # noqa: B018 - raises AttributeError where there is no prctl
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0]
