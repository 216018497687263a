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
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

__all__ = ["StopSignals", "stop_requested"]

# Signals are delivered to the process, so the request is process state, not a scope.
_requested = threading.Event()
_received = [0]


class StopSignals:
    """SIGTERM handling for the duration of one launch block (main thread only)."""

    def __init__(self, forward: Callable[[int], None] | None = None) -> None:
        self._forward = forward
        self._previous: Any = None
        self._installed = False

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        _requested.clear()
        _received[0] = 0

    def _handle(self, signum: int, frame: Any) -> None:
        _received[0] += 1
        if self._forward is not None:
            self._forward(signum)
        if _received[0] == 1:
            _requested.set()
            return
        raise SystemExit(128 + signum)


def stop_requested() -> bool:
    """Whether this process received a SIGTERM during the open launch block."""
    return _requested.is_set()
