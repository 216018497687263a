"""SIGTERM during a launch block: what SLURM and Kubernetes send before preemption.

The first SIGTERM does not kill anything: it marks a stop as requested (and the main process
forwards it to its workers), so the training loop can notice it at a step boundary, save a
checkpoint and leave::

    for x, y in loader:
        ...
        if lite.should_stop():          # True on every rank at the same step
            lite.save("ckpt.pt", state)
            break

A second SIGTERM stops at once (``SystemExit(143)``); the launcher then ends every rank.

A run that cannot reach a stop, because its ranks wait in a collective that will never
complete, cannot even run Python's handler: CPython runs handlers between bytecodes, and the
main thread is blocked in C++. The C-level handler still writes the signal's number to the
file descriptor of ``signal.set_wakeup_fd``, so the hang watchdog (``watchdog.py``) learns of
the SIGTERM from a thread and ends such a run after a grace period (:class:`SignalWatch`).

The main process forwards the request to its workers with a signal of its own
(:data:`STOP_REQUEST_SIGNAL`), not with SIGTERM: when SIGTERM reaches every process of the run
at once (systemd stopping a service, a scheduler signalling the whole tree), a worker then
counts one SIGTERM, its own, and stops cleanly like the others instead of taking the forwarded
copy for a second SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable

from scopedlite._core.process import this_process

__all__ = ["SignalWatch", "StopSignals", "stop_requested"]

# "Rank 0 was asked to stop": a real-time signal nothing else uses. Where there is none
# (macOS), SIGTERM itself is forwarded, as before.
STOP_REQUEST_SIGNAL: int = (signal.SIGRTMIN + 5) if hasattr(signal, "SIGRTMIN") else signal.SIGTERM


class StopSignals:
    """SIGTERM handling for the duration of one launch block (main thread only)."""

    def __init__(self, forward: Callable[[int], None] | None = None) -> None:
        self._forward = forward
        self._previous: Any = None
        self._installed = False
        self._received = 0  # SIGTERMs during this block

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            if STOP_REQUEST_SIGNAL != signal.SIGTERM:
                signal.signal(STOP_REQUEST_SIGNAL, self._handle_request)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            if STOP_REQUEST_SIGNAL != signal.SIGTERM:
                # ours alone: a request arriving late (the block is over) must not kill
                signal.signal(STOP_REQUEST_SIGNAL, signal.SIG_IGN)
            self._installed = False
        # Signals are delivered to the process: the request is process state (_core/process.py)
        this_process.stop_request.clear()
        self._received = 0

    def _handle(self, signum: int, frame: Any) -> None:
        self._received += 1
        if self._forward is not None and self._received == 1:
            self._forward(STOP_REQUEST_SIGNAL)  # a second SIGTERM: the launcher ends them all
        if self._received == 1:
            this_process.stop_request.set()
            return
        raise SystemExit(128 + signum)

    def _handle_request(self, signum: int, frame: Any) -> None:
        """The main process forwarded a stop request: like a first SIGTERM, never a second."""
        this_process.stop_request.set()


def stop_requested() -> bool:
    """Whether this process received a SIGTERM during the open launch block."""
    return this_process.stop_request.is_set()


class SignalWatch:
    """Whether a SIGTERM arrived, readable from any thread even while the main thread is
    blocked in C code: a pipe given to ``signal.set_wakeup_fd`` (main thread only).

    Where another wakeup descriptor is set already (asyncio, a notebook kernel, our
    supervisor, which has its own), it stays, and only Python's handler tells.
    """

    def __init__(self) -> None:
        self._read = self._write = -1
        self._seen = False
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:  # someone listens already: theirs stays
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return
        self._read, self._write = read, write

    def sigterm_seen(self) -> bool:
        if not self._seen and self._read != -1:
            try:
                data = os.read(self._read, 64)
            except OSError:  # nothing written yet (BlockingIOError), or closed
                data = b""
            self._seen = signal.SIGTERM in data or STOP_REQUEST_SIGNAL in data
        return self._seen or stop_requested()

    def close(self) -> None:
        """Give the wakeup descriptor back (main thread)."""
        if self._read != -1:
            signal.set_wakeup_fd(-1)
            os.close(self._read)
            os.close(self._write)
            self._read = self._write = -1
