"""Telling the ranks apart when they print to one terminal.

The workers our launcher starts share rank 0's terminal (or the notebook cell). Once a
worker joins its launch block, every line it writes to ``sys.stdout`` and ``sys.stderr`` is
prefixed with ``[rank N] ``. Rank 0 stays unprefixed: it is the process the user started,
whose output before and after the block is the program's own, and ``lite.print`` (rank 0
only) reads like ``print``. ``SCOPEDLITE_RANK_PREFIX=0`` turns the prefix off.

Worlds started by other tools are left alone: they have their own switch (``srun
--label``, ``mpirun --tag-output``, ``torchrun --tee``/``--local-ranks-filter``).
Only Python-level writes are prefixed; output written by C code straight to the file
descriptor (a gloo warning) is not.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

__all__ = ["PREFIX_ENV", "RankPrefixed", "install_rank_prefix"]

PREFIX_ENV = "SCOPEDLITE_RANK_PREFIX"


class RankPrefixed:
    """A text stream that starts each line written to ``stream`` with ``prefix``.

    A line is held until it is complete (or ``flush`` is called) and complete lines are
    written and flushed at once, so the lines of processes sharing one pipe interleave
    whole instead of mid-line. Everything else (``fileno``, ``isatty``, ``encoding``, ...)
    is the wrapped stream's.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending = ""  # the start of a line not yet complete
        self._continues = False  # a flushed partial line is still open (no prefix next)

    @property
    def wrapped(self) -> TextIO:
        return self._stream

    def _prefixed(self, text: str) -> str:
        out = []
        for line in text.splitlines(keepends=True):
            if line.strip("\n") and not self._continues:
                out.append(self._prefix)
            out.append(line)
            self._continues = False
        return "".join(out)

    def write(self, text: str) -> int:
        data = self._pending + text
        end = data.rfind("\n") + 1
        self._pending = data[end:]
        if end:
            self._stream.write(self._prefixed(data[:end]))
            self._stream.flush()
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._prefixed(self._pending))
            self._pending, self._continues = "", True
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def prefix_enabled(env: Any = None) -> bool:
    """Whether ranks prefix their lines: on unless ``SCOPEDLITE_RANK_PREFIX`` is 0/false/no/off."""
    value = (os.environ if env is None else env).get(PREFIX_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def install_rank_prefix(rank: int) -> None:
    """Prefix this worker's ``sys.stdout``/``sys.stderr`` lines with ``[rank N] ``.

    Called once a worker of ours (re-executed or forked) has joined its launch block; the
    process ends with the block, so nothing is restored. Rank 0 is never prefixed.
    """
    if rank == 0 or not prefix_enabled():
        return
    prefix = f"[rank {rank}] "
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RankPrefixed):
            setattr(sys, name, RankPrefixed(stream, prefix))
