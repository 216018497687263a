"""Telling the ranks apart when they print to one terminal, line by line.

The workers our launcher starts share rank 0's terminal (or the notebook cell). Inside a
launch block every rank's ``sys.stdout`` and ``sys.stderr`` hand the terminal whole lines
only: a line is held until it is complete (or flushed), and complete lines go out in one
write each, so two ranks printing at the same moment never end up on one line. That holds for
rank 0 too, whose own ``print`` is otherwise two writes (the text, then ``"\n"``) when Python
runs unbuffered, and whose buffered output would otherwise go out in 8 KiB blocks cut
anywhere.

A worker's lines start with ``[rank N] ``. Rank 0 stays unprefixed: it is the process the
user started, whose output before and after the block is the program's own, and
``lite.print`` (rank 0 only) reads like ``print``. ``SCOPEDLITE_RANK_PREFIX=0`` turns the
prefix off (lines stay whole). Rank 0's streams are given back at the end of the block;
workers leave the process there.

A write of up to ``PIPE_BUF`` bytes (4096 on Linux) to a pipe is atomic, so lines are
written in groups of at most that size, cut between lines; only a single line longer than
that may be split by the system when the pipe is full.

Worlds started by other tools are left alone: they have their own switch (``srun
--label``, ``mpirun --tag-output``, ``torchrun --tee``/``--local-ranks-filter``).
Only Python-level writes are handled; output written by C code straight to the file
descriptor (a gloo warning) is not.
"""

from __future__ import annotations

import functools
import os
import select
import sys
import threading
import weakref
from typing import Any, Iterator, TextIO

__all__ = ["PREFIX_ENV", "HeldLines", "RankPrefixed", "install_rank_prefix"]

PREFIX_ENV = "SCOPEDLITE_RANK_PREFIX"
_ATOMIC = getattr(select, "PIPE_BUF", 512)  # POSIX guarantees at least 512


class RankPrefixed:
    """A text stream that starts each line written to ``stream`` with ``prefix``.

    A line is held until it is complete (or ``flush`` is called) and complete lines are
    written and flushed at once, in groups of at most ``PIPE_BUF`` bytes cut between lines,
    so the lines of processes sharing one pipe interleave whole instead of mid-line. With
    an empty prefix it only does that. Everything else (``fileno``, ``isatty``,
    ``encoding``, ...) is the wrapped stream's.
    """

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending = ""  # the start of a line not yet complete
        self._continues = False  # a flushed partial line is still open (no prefix next)
        self._lock = threading.Lock()  # threads of one process share the held line
        if hasattr(os, "register_at_fork"):  # a child forked mid-write (a DataLoader worker) gets a free lock
            os.register_at_fork(after_in_child=functools.partial(_call, weakref.WeakMethod(self._relock)))

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
        with self._lock:
            data = self._pending + text
            end = data.rfind("\n") + 1
            self._pending = data[end:]
            if end:
                for chunk in _groups(self._prefixed(data[:end]), self._encoding()):
                    self._stream.write(chunk)
                    self._stream.flush()
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._stream.write(self._prefixed(self._pending))
                self._pending, self._continues = "", True
            self._stream.flush()

    def _relock(self) -> None:
        self._lock = threading.Lock()

    def _encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _call(method: weakref.WeakMethod[Any]) -> None:
    bound = method()
    if bound is not None:
        bound()


def _groups(text: str, encoding: str) -> Iterator[str]:
    """``text`` (whole lines) in pieces of at most ``PIPE_BUF`` encoded bytes, cut between
    lines; a longer line is a piece of its own."""
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        n = len(line.encode(encoding, "replace"))
        if piece and size + n > _ATOMIC:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += n
    if piece:
        yield "".join(piece)


class HeldLines:
    """``sys.stdout`` and ``sys.stderr`` handing out whole lines (prefixed with ``prefix``)
    until :meth:`restore` puts the streams back, flushing what is held."""

    def __init__(self, prefix: str) -> None:
        self._saved: dict[str, TextIO] = {}
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is not None and not isinstance(stream, RankPrefixed):
                self._saved[name] = stream
                setattr(sys, name, RankPrefixed(stream, prefix))

    def restore(self) -> None:
        """Put back the streams this replaced, unless the program replaced them since."""
        for name, stream in self._saved.items():
            held = getattr(sys, name)
            if isinstance(held, RankPrefixed) and held.wrapped is stream:
                held.flush()
                setattr(sys, name, stream)
        self._saved = {}


def prefix_enabled(env: Any = None) -> bool:
    """Whether ranks prefix their lines: on unless ``SCOPEDLITE_RANK_PREFIX`` is 0/false/no/off."""
    value = (os.environ if env is None else env).get(PREFIX_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def install_rank_prefix(rank: int) -> HeldLines:
    """Make this process's ``sys.stdout``/``sys.stderr`` hand out whole lines, prefixed with
    ``[rank N] `` unless this is rank 0 or the prefix is turned off.

    Called once a worker of ours (re-executed or forked) has joined its launch block (the
    process ends with the block, so nothing is restored), and by rank 0 for the block, which
    restores its streams at the end.
    """
    return HeldLines(f"[rank {rank}] " if rank != 0 and prefix_enabled() else "")
