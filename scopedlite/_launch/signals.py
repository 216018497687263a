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

The main process forwards the request to its workers with a signal of its own
(:data:`STOP_REQUEST_SIGNAL`), not with SIGTERM: when SIGTERM reaches every process of the run
at once (systemd stopping a service, a scheduler signalling the whole tree), a worker then
counts one SIGTERM, its own, and stops cleanly like the others instead of taking the forwarded
copy for a second SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

__all__ = ["StopSignals", "stop_requested"]

# Signals are delivered to the process, so the request is process state, not a scope.
_requested = threading.Event()
_received = [0]

# "Rank 0 was asked to stop": a real-time signal nothing else uses. Where there is none
# (macOS), SIGTERM itself is forwarded, as before.
STOP_REQUEST_SIGNAL: int = (signal.SIGRTMIN + 5) if hasattr(signal, "SIGRTMIN") else signal.SIGTERM


class StopSignals:
    """SIGTERM handling for the duration of one launch block (main thread only)."""

    def __init__(self, forward: Callable[[int], None] | None = None) -> None:
        self._forward = forward
        self._previous: Any = None
        self._installed = False

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
        _requested.clear()
        _received[0] = 0

    def _handle(self, signum: int, frame: Any) -> None:
        _received[0] += 1
        if self._forward is not None and _received[0] == 1:
            self._forward(STOP_REQUEST_SIGNAL)  # a second SIGTERM: the launcher ends them all
        if _received[0] == 1:
            _requested.set()
            return
        raise SystemExit(128 + signum)

    def _handle_request(self, signum: int, frame: Any) -> None:
        """The main process forwarded a stop request: like a first SIGTERM, never a second."""
        _requested.set()


def stop_requested() -> bool:
    """Whether this process received a SIGTERM during the open launch block."""
    return _requested.is_set()
