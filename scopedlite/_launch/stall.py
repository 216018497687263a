"""Is this rank waiting for the others? One look at the main thread, and what counts as progress.

The hang watchdog (``watchdog.py``) looks at the thread that runs the launch block (the main
thread, but for Ray Train's training thread) every few seconds. A look says
*waiting* when the innermost Python frame is one of the places where a rank waits for its
peers: a ``torch.distributed`` collective (c10d, functional collectives, FSDP2's all-gather
and reduce-scatter waits), DeepSpeed's ``deepspeed.comm``, or our own communication
(``scopedlite/_comm``: our collectives and the end-of-block barrier), or the gather ledger's
check that every rank reaches a step (a poll of the store: before, a rank left polling there
by one the ledger cannot see was *working* until the collective timeout, SIGTERM included).
Anything else is
*working*: Python code, a checkpoint being written. Only the innermost frame counts:
torchrun's ``@record`` wraps the whole program in a ``torch.distributed`` frame. A backward
(torch's autograd engine, in C++) and DDP's forward are both: DDP's gradient all-reduce,
FSDP's reduce-scatter and DDP's bucket rebuild are waited for in there, out of Python's
sight, so a rank in one counts as waiting only while its process uses next to no CPU
(:data:`BUSY_SHARE`); computing, it works. Before, a rank that went on to its next backward
while another called a collective alone (``if rank == 0: lite.barrier()``) was *working* for
ever, and the run hung until the collective timeout (30 minutes), SIGTERM included.

A rank waits *continuously* only while nothing moves. A new wait begins (the episode number
goes up) whenever a look finds the rank working, in another place, or when anything shows
that the wait is moving data: the sequence numbers of its process groups changed (a loop of
small collectives, each look landing in one of them), or the process wrote more than
:data:`WRITTEN_BYTES` since the last look (gloo sends with ``write``; a long transfer of a big
tensor is no hang). A wrong *working* only delays the report (the collective timeout stays the
backstop); a wrong *waiting* would end a healthy run, so every doubt counts as progress.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Callable

__all__ = [
    "DTENSOR_WAIT",
    "JOIN_BLOCK_END",
    "LEDGER_WAIT",
    "Look",
    "Progress",
    "bytes_written",
    "format_stack_of",
    "frame_of",
    "look_at",
]

# The places where a rank waits for its peers, as path endings (``/`` separated).
_WAIT_FILES = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/c10d_logger.py",
    "torch/distributed/_functional_collectives.py",
    "torch/distributed/_functional_collectives_impl.py",
    "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
    "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py",
)
_WAIT_FOLDERS = ("/deepspeed/comm/", "/scopedlite/_comm/")
# Where torch waits for its peers in C++, out of Python's sight, inside work: a backward runs
# torch's autograd engine, where DDP's gradient all-reduce and FSDP's reduce-scatter are
# waited for; DDP's forward rebuilds its buckets and broadcasts buffers from C++. A rank in
# there is waiting only while its process uses next to no CPU (see ``Progress``); computing,
# it works. (path ending, function or None for any, what the report calls the wait)
_IN_CPP = (
    ("torch/autograd/graph.py", "_engine_run_backward", "a backward's gradient collectives"),
    ("torch/nn/parallel/distributed.py", None, "DistributedDataParallel's forward collectives"),
)
#: A rank in a backward whose process used more CPU than this share of the time between two
#: looks is computing (a wait in gloo or NCCL blocks its threads and uses next to none).
BUSY_SHARE = 0.1
# Frames a wait calls into briefly and returns from (rank 0's end-of-block barrier asks the
# supervisor at every poll whether a worker failed), or through which it calls its C++ wait
# (torch's op wrapper, under a functional collective's wait_tensor: a DTensor's redistribution
# of FSDP's or tensor parallelism's shards): seen innermost, they do not end a wait, and what
# called them tells whether the rank waits or works.
_PASSING = ("/scopedlite/_launch/supervise.py", "/torch/_ops.py")
# Our waits at the end of a launch block (through the store, or gloo's monitored barrier).
_BLOCK_END = ("end_of_block_barrier", "meet_at_block_end", "final_gloo_barrier")
# lite.join's rounds, named by the session's step that opened them (join/session.py).
_JOIN_SESSION = "/scopedlite/_strategies/join/session.py"
JOIN_BLOCK_END = "lite.join's round at the end of its block"
_JOIN_ROUNDS = {
    "_leave": JOIN_BLOCK_END,
    "loader_pass": "lite.join's round at a pass over a loader",
    "before_forward": "lite.join's round before a forward",
    "before_backward": "lite.join's round before a backward",
    "before_step": "lite.join's round before an optimizer step",
    "clip_gradients": "lite.join's round before lite.clip_gradients",
    "_announce_collective": "lite.join's round before a lite collective",
}
# The gather ledger's checks (lockstep.py) read the other ranks' lines on the store until
# they reach this rank's step: a wait on peers in Python, alternating between a read and a
# pause, so the place of such a wait is its polling function, not its line. A rank the ledger
# cannot see (in a raw torch.distributed call) leaves the checking rank there.
_LEDGER = "/scopedlite/_strategies/lockstep.py"
_LEDGER_POLL, _LEDGER_READ = "_poll", "_entries"
LEDGER_WAIT = "the gather ledger's check that every rank reaches this step"
# A DTensor operation that needs other ranks' shards (a norm of FSDP's sharded parameters
# read with float(), full_tensor()) waits in a functional collective under this folder.
_DTENSOR = "/torch/distributed/tensor/"
DTENSOR_WAIT = "a DTensor's collective (an operation on sharded parameters or gradients)"
# Library code: the caller named in a wait's description is the first frame outside these.
_LIBRARIES = ("/torch/", "/deepspeed/", "/scopedlite/", "/contextlib.py", "/threading.py")

#: More than this written by the process between two looks counts as progress (gloo sends a
#: collective's data with ``write``; a hung rank writes nothing).
WRITTEN_BYTES = 64 * 1024


@dataclass(frozen=True)
class Look:
    """What one look at the main thread saw.

    Attributes:
        where: What the thread waits in, with the user's line that called it
            (``"all_reduce (train.py:12)"``); None when it is working.
        place: The innermost frame (file, line): a wait that moves is a new one.
        idle_only: A backward (torch's autograd engine): a wait only while the process
            uses next to no CPU, which only :class:`Progress` can tell.
    """

    where: str | None
    place: tuple[str, int]
    idle_only: bool = False

    @property
    def waiting(self) -> bool:
        return self.where is not None


def _normal(path: str) -> str:
    return path.replace(os.sep, "/")


def _is_wait(path: str) -> bool:
    path = _normal(path)
    return path.endswith(_WAIT_FILES) or any(folder in path for folder in _WAIT_FOLDERS)


def look_at(frame: FrameType | SeenFrame | None) -> Look:
    """Classify a thread's innermost ``frame`` (see the module docstring)."""
    while frame is not None and any(p in _normal(frame.f_code.co_filename) for p in _PASSING):
        frame = frame.f_back
    if frame is None:
        return Look(None, ("", 0))
    poll = _ledger_poll(frame)
    if poll is not None:  # one place however its lines alternate
        frame, place = poll, (poll.f_code.co_filename, poll.f_code.co_firstlineno)
    else:
        place = (frame.f_code.co_filename, frame.f_lineno or 0)
    in_cpp = _in_cpp(frame)
    if not (in_cpp or poll is not None or _is_wait(frame.f_code.co_filename)):
        return Look(None, place)
    # or the collective itself: all_reduce, barrier, ...
    waits_in = in_cpp or (LEDGER_WAIT if poll is not None else frame.f_code.co_name)
    caller: FrameType | SeenFrame | None = frame
    while caller is not None and _is_wait(caller.f_code.co_filename):
        if caller.f_code.co_name in _BLOCK_END:
            waits_in = "the end of the launch block"
        caller = caller.f_back
    if caller is not None and _DTENSOR in _normal(caller.f_code.co_filename):
        waits_in = DTENSOR_WAIT  # torch's op on a DTensor, not the collective's own name
    in_round: bool | None = None  # the wait is a join round's own exchange (not a replay's collective)
    while caller is not None and any(lib in _normal(caller.f_code.co_filename) for lib in _LIBRARIES):
        if in_round is not False and _normal(caller.f_code.co_filename).endswith(_JOIN_SESSION):
            name = caller.f_code.co_name
            if in_round and name in _JOIN_ROUNDS:
                waits_in, in_round = _JOIN_ROUNDS[name], False
            elif in_round is None:
                in_round = name == "_exchange"
        caller = caller.f_back
    if caller is not None:
        waits_in += f" ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"
    return Look(waits_in, place, idle_only=bool(in_cpp))


def _ledger_poll(frame: FrameType | SeenFrame) -> FrameType | SeenFrame | None:
    """The gather ledger's polling frame, where ``frame`` is it or its read of the store."""
    if not _normal(frame.f_code.co_filename).endswith(_LEDGER):
        return None
    if frame.f_code.co_name == _LEDGER_READ and frame.f_back is not None:
        frame = frame.f_back
    return frame if frame.f_code.co_name == _LEDGER_POLL else None


def _in_cpp(frame: FrameType | SeenFrame) -> str | None:
    """What torch may wait in, in C++, below ``frame`` (see ``_IN_CPP``), or None."""
    path = _normal(frame.f_code.co_filename)
    for ending, function, what in _IN_CPP:
        if path.endswith(ending) and function in (None, frame.f_code.co_name):
            return what
    return None


# A look at the main thread holds CPython's thread-list lock, and a finalizer run by a
# collection in the middle of it may let another thread take the GIL. A fork at that moment (a
# DataLoader worker) would copy the lock held, and the child would hang in its first
# thread-state clean-up (CPython 3.11). The fork waits for the look instead.
_looking = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_looking.acquire, after_in_parent=_looking.release, after_in_child=_looking.release)


@dataclass(frozen=True)
class SeenCode:
    """What :func:`frame_of` tells of a frame's code (the names of a code object's fields)."""

    co_filename: str
    co_name: str
    co_firstlineno: int = 0  # not told: a place is its file and function


@dataclass(frozen=True)
class SeenFrame:
    """One frame of another thread's stack, copied (the names of a frame object's fields)."""

    f_code: SeenCode
    f_lineno: int
    f_back: SeenFrame | None


_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) ")
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')


def frame_of(thread: int) -> SeenFrame | None:
    """The innermost Python frame of ``thread`` (an ident), seen from another thread.

    Copied from faulthandler's dump of every thread, which reads the stacks in C while this
    thread holds the GIL, so no other thread moves meanwhile. Frame objects from
    ``sys._current_frames()``, walked in Python, can be preempted half-way: the other thread
    then pops frames under the walk, and on CPython 3.11 the walk read a freed frame and the
    process died of a segmentation fault (seen once in CI, torch 2.9, the watched thread
    entering a gloo broadcast). The dump stops at 100 frames (the outermost ones are left out).
    """
    with _looking, tempfile.TemporaryFile() as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        text = out.read().decode("utf-8", errors="replace")
    frames: list[tuple[str, int, str]] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            if frames is not None:
                break
            frames = [] if int(header.group(1), 16) == thread else None
        elif frames is not None and (found := _FRAME.match(line)) is not None:
            number = found.group(2)
            frames.append((found.group(1), int(number) if number.isdigit() else 0, found.group(3)))
    seen: SeenFrame | None = None
    for filename, lineno, name in reversed(frames or []):  # outermost first
        seen = SeenFrame(SeenCode(filename, name), lineno, seen)
    return seen


def format_stack_of(thread: int) -> str:
    """``thread``'s Python stack, innermost last, as a traceback shows it."""
    frame = frame_of(thread)
    lines: list[str] = []
    while frame is not None:
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        entry = f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}'
        lines.append(f"{entry}\n    {source}" if source else entry)
        frame = frame.f_back
    return "\n".join(reversed(lines)) if lines else "(no Python stack)"


class Progress:
    """Turns looks into wait episodes: the number goes up whenever the rank is not provably
    standing still (see the module docstring).

    Args:
        sequence_numbers: The sequence numbers of this process's groups (each collective
            moves one), or None where torch cannot say.
        written: Bytes the process wrote so far, or None where the system cannot say.
        clocks: The process's CPU time and the wall time, in seconds (a look inside a
            backward is a wait only while the first hardly moves: see :data:`BUSY_SHARE`).
    """

    def __init__(
        self,
        sequence_numbers: Callable[[], tuple[int, ...] | None],
        written: Callable[[], int | None],
        clocks: Callable[[], tuple[float, float]] = lambda: (time.process_time(), time.monotonic()),
    ) -> None:
        self._sequence_numbers = sequence_numbers
        self._written = written
        self._clocks = clocks
        self.episode = 0
        self._last: tuple[Look, tuple[int, ...] | None, int | None, tuple[float, float]] | None = None

    def update(self, look: Look) -> int:
        """Record one look; return the wait episode it belongs to."""
        numbers, written, clocks = self._sequence_numbers(), self._written(), self._clocks()
        last, self._last = self._last, (look, numbers, written, clocks)
        if last is None or not look.waiting:
            self.episode += 1
            return self.episode
        before, numbers_before, written_before, clocks_before = last
        cpu, wall = clocks[0] - clocks_before[0], clocks[1] - clocks_before[1]
        moved = (
            look != before
            or numbers is None
            or numbers != numbers_before
            or (written is not None and written_before is not None and written - written_before > WRITTEN_BYTES)
            or (look.idle_only and cpu > BUSY_SHARE * wall)
        )
        if moved:
            self.episode += 1
        return self.episode


def bytes_written() -> int | None:
    """What this process wrote so far (``wchar`` of ``/proc/self/io``), None off Linux."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
