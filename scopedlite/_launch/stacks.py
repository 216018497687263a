"""Where was every rank? Python stacks of the workers, gathered by the main process.

Workers register a faulthandler dump on a dedicated signal; when a collective of the main
process times out, it signals every live worker and reads what they wrote, so the error shows
which rank was stuck where (typically: one rank skipped a collective the others wait in).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from scopedlite._core.process import this_process

__all__ = [
    "STACK_SIGNAL",
    "CollectiveTimeoutError",
    "FatalStacks",
    "collect_stacks",
    "enable_stack_dumps",
    "looks_like_timeout",
    "says_timed_out",
]

STACK_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1


class CollectiveTimeoutError(TimeoutError):
    """A collective waited longer than ``launch(timeout=...)``, or every rank waited for the
    others with nothing moving (the hang watchdog: ``SCOPEDLITE_HANG_TIMEOUT``, or after a
    SIGTERM ``SCOPEDLITE_TERM_GRACE``); shows where every rank was.

    Attributes:
        stacks: Each worker's Python stacks (all threads) at the time of the timeout, by rank.
    """

    def __init__(
        self,
        cause: BaseException,
        stacks: dict[int, str],
        world_size: int,
        *,
        headline: str | None = None,
        rank0_stack: str | None = None,
    ) -> None:
        import traceback

        self.stacks = stacks
        if headline is None:
            headline = (
                f"A collective timed out on rank 0 ({type(cause).__name__}: "
                f"{str(cause).splitlines()[0] if str(cause) else ''}). "
                "Where every rank was (a rank that is not inside the same collective skipped it):"
            )
        if rank0_stack is None:
            rank0_stack = "".join(traceback.format_tb(cause.__traceback__)).rstrip()
        lines = [headline, "\n--- rank 0 ---\n" + rank0_stack]
        for rank in range(1, world_size):
            stack = stacks.get(rank)
            note = ""
            if stack and "in end_of_block_barrier" in stack:
                note = " (done with the block's body: it waits at the end of the launch block)"
            lines.append(
                f"\n--- rank {rank}{note} ---\n" + (stack.rstrip() if stack else "(no stack: the rank did not answer)")
            )
        super().__init__("\n".join(lines))


def stack_file(error_dir: Path, rank: int) -> Path:
    return error_dir / f"stack{rank}.txt"


class FatalStacks:
    """For a multi-process block: a rank killed by a fatal signal (SIGABRT: gloo or NCCL
    aborting on a collective mismatch; SIGSEGV) prints where each of its Python threads was
    to its stderr (faulthandler), beside torch's one-line C++ message, instead of nothing.
    Left as it is where faulthandler is on already (pytest, ``python -X faulthandler``), or
    where stderr has no file descriptor (a notebook); undone at the end of the block."""

    def __init__(self) -> None:
        self._enabled = False

    def install(self) -> FatalStacks:
        stream = sys.__stderr__
        if faulthandler.is_enabled() or stream is None:
            return self
        try:
            faulthandler.enable(file=stream, all_threads=True)
        except (ValueError, OSError, AttributeError):  # no usable descriptor: nothing to print to
            return self
        self._enabled = True
        return self

    def uninstall(self) -> None:
        if self._enabled:
            faulthandler.disable()
            self._enabled = False


def enable_stack_dumps(path: Path) -> None:
    """In a worker: dump all threads' stacks to ``path`` when STACK_SIGNAL arrives."""
    handle = open(path, "w")  # noqa: SIM115 - kept open for the life of the worker
    this_process.stack_files.append(handle)
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True)


def collect_stacks(workers: list[Any], error_dir: Path, wait: float = 1.0) -> dict[int, str]:
    """In the main process: ask every live worker for its stack and read the answers."""
    asked = []
    for worker in workers:
        if worker.poll() is None:
            try:
                os.kill(worker.pid, STACK_SIGNAL)
                asked.append(worker.rank)
            except ProcessLookupError:
                continue
    deadline = time.monotonic() + wait
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline and len(stacks) < len(asked):
        for rank in asked:
            path = stack_file(error_dir, rank)
            text = path.read_text() if path.exists() else ""
            if "File" in text:
                stacks[rank] = text
        time.sleep(0.02)
    time.sleep(0.05)
    return {rank: stack_file(error_dir, rank).read_text() for rank in stacks}


def looks_like_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or store wait that ran out of time, not any error whose
    message mentions a timeout."""
    return isinstance(exc, TimeoutError) or says_timed_out(str(exc))


def says_timed_out(message: str) -> bool:
    """Whether an error message says a collective or store wait ran out of time (gloo: "Timed
    out waiting ...", the store: "... timed out ..." / "Socket Timeout" / "Wait timeout")."""
    text = message.lower()
    return "timed out" in text or "socket timeout" in text or "wait timeout" in text
