"""What belongs to this process rather than to any run: the one place of process-wide state.

Whatever a launch block needs is owned by its run: the :class:`~scopedlite._core.run.Run`, the
strategy it holds (with the registry of what it set up, ``_strategies/set_up.py``) and the
role that started it. A block that ends takes its state with it, so a later block in the same
process (a notebook's tenth cell) starts as cleanly as the first. What is here outlives every
block on purpose, each piece for its reason:

- **The launch blocks this interpreter entered** (:meth:`ThisProcess.enter`): a worker that
  re-executes the script runs it from the top and must take part in the block it was started
  for, not in an earlier one. A block is therefore named by its site *and* by how many times
  the process entered that site (``x.py:3#2``); and once a multi-process block has started,
  a later one must fork (:attr:`ThisProcess.launched`): a re-executed script would run the
  earlier block again.
- **The launch blocks open now** (:attr:`ThisProcess.open_launches`): threads start with
  empty context variables, so a thread started inside a block finds its run here; it holds
  only the blocks open at this moment.
- **A stop request** (:attr:`ThisProcess.stop_request`): signals are delivered to the process,
  not to a scope. The open block's SIGTERM handler sets it and the end of the block clears it.
- **Process groups of ended runs** (:attr:`ThisProcess.retired_groups`): a user object kept
  past its run (a DDP model in a notebook's namespace) holds that run's gloo group; a worker
  forked for a later block inherits the object, and were the worker to drop it, the group's
  destructor would wait on gloo threads only the parent has. Held here until the process
  exits, no forked copy is ever the last owner (``_comm/distributed.py``).
- **A worker's stack-dump file** (:attr:`ThisProcess.stack_files`): faulthandler writes into
  it on a signal for the life of the worker process (``_launch/stacks.py``).
- **The names of call sites seen** (:attr:`ThisProcess.site_names`): a join round carries a
  call site (``file:line``) as a small integer, the same on every rank; each rank names the
  integers it made. They name lines of code, which are the process's, not a run's, and a later
  block that calls from the same line reads the same name (``_strategies/join/message.py``).
"""

from __future__ import annotations

import os
import threading
from typing import IO, Any

__all__ = ["OpenLaunches", "StopRequest", "ThisProcess", "describe_identity", "this_process"]


class OpenLaunches:
    """The launch blocks open in this process, in any thread.

    When exactly one block is open in the process, that is the run a thread started without
    the run's context belongs to; with two open (launch blocks in two threads), such a thread
    cannot tell which, and ``active_launch`` refuses (``run.py``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[tuple[int, Any]] = []  # (pid, scope): a forked child inherits the list

    def add(self, scope: Any) -> None:
        with self._lock:
            self._open.append((os.getpid(), scope))

    def remove(self, scope: Any) -> None:
        with self._lock:
            self._open = [(pid, s) for pid, s in self._open if s is not scope and pid == os.getpid()]

    def here(self) -> list[Any]:
        pid = os.getpid()
        with self._lock:
            return [s for p, s in self._open if p == pid]


class StopRequest:
    """Whether this process was asked to stop: a plain flag, set by signal handlers and read
    anywhere.

    Not a ``threading.Event``: its ``set()`` takes a lock, and a signal handler runs between
    two bytecodes of the main thread, possibly inside another handler's ``set()``. When a
    SIGTERM and the main process's forwarded stop request reached a worker at once (systemd
    stopping a service), the second handler waited for the lock the first held, and the
    worker hung for good (about one run in ten of test_faults' SIGTERM-to-every-process test).
    Assigning a bool takes no lock."""

    def __init__(self) -> None:
        self._requested = False

    def set(self) -> None:
        self._requested = True

    def clear(self) -> None:
        self._requested = False

    def is_set(self) -> bool:
        return self._requested


class ThisProcess:
    """The process-wide state of the module docstring, each piece an attribute set here."""

    def __init__(self) -> None:
        self.launched = False  # a multi-process block (script or fork) was started
        self._entered_at: dict[str, int] = {}  # how many launch blocks entered at each file:line
        self.open_launches = OpenLaunches()
        self.stop_request = StopRequest()
        self.retired_groups: list[tuple[int, Any]] = []  # (pid of the retiring process, group)
        self.stack_files: list[IO[str]] = []
        self.site_names: dict[int, str] = {}  # crc32 of a call site -> its "file:line"

    def enter(self, site: str) -> str:
        """Count one more entry of the launch block at ``site``; return its identity
        (``site#n``), which a worker started for it is given."""
        self._entered_at[site] = self._entered_at.get(site, 0) + 1
        return f"{site}#{self._entered_at[site]}"

    def blocks_entered(self) -> int:
        """How many launch blocks this process has entered: what separates one use of the
        default run (outside every block) from the next."""
        return sum(self._entered_at.values())


this_process = ThisProcess()


def describe_identity(identity: str) -> str:
    """``x.py:3#2`` -> ``x.py:3 (launch block number 2 entered there)``."""
    site, _, count = identity.rpartition("#")
    if not site or count == "1":
        return site or identity
    return f"{site} (launch block number {count} entered there)"
