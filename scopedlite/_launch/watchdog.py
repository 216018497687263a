"""The hang watchdog: a run whose ranks all wait for each other, and nothing moves, is ended
with where every rank was, instead of waiting out the collective timeout (30 minutes).

Each rank of a multi-process block runs one daemon thread, from the start of the block to its
end (never one per step). Every few seconds it looks at the main thread (``stall.py``: waiting
in communication, or working) and publishes on the run's store the wait episode it is in, what
it waits in, and whether it was asked to stop. Global rank 0 reads every rank's entry and
decides: when *every* rank has stood in the same wait for the stall window
(``SCOPEDLITE_HANG_TIMEOUT``, default 120 s) on two looks in a row, that is a desync: a rank
skipped a collective the others are in, or called another one. A rank that works (rank 0
alone writing a checkpoint or evaluating while the others wait in ``lite.barrier()``) is no
stall, however long it takes.

After a SIGTERM (a stop request: ``lite.should_stop()``) the window shrinks to the grace
period (``SCOPEDLITE_TERM_GRACE``, default 30 s): a run that cannot reach the stop because
every rank waits in a collective is ended within it, a run that is saving is not.

How the run ends:

- A run our launcher started: rank 0's supervisor collects every worker's stack, stops them,
  and rank 0's collective fails; the launch raises ``lite.CollectiveTimeoutError`` with the
  diagnosis (``Parent._report``).
- A world someone else started (torchrun, SLURM, MPI): nothing of ours can stop the other
  processes, so each ends itself: rank 0 publishes the verdict, every rank prints it with what
  it waits in and its own stack to its stderr and leaves with exit code 1, which ends the job
  under torchrun's agent, ``srun`` and ``mpirun``. The block's exception handling does not
  run: the main thread cannot be interrupted inside C++.
- A main thread that still waits :data:`END_WAIT_S` after the verdict (stuck where nothing
  can interrupt it) is ended by the watchdog with the same report on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from scopedlite._launch.stall import JOIN_BLOCK_END, Progress, bytes_written, format_stack_of, frame_of, look_at
from scopedlite._private.torch_internals import group_sequence_numbers

__all__ = ["END_WAIT_S", "Diagnosis", "HangWatchdog", "Limits"]

#: How long the main thread may still wait once the run was found stalled and ended.
END_WAIT_S = 10.0
_EXIT_CODE = 1


@dataclass(frozen=True)
class Limits:
    """When the watchdog ends a run (seconds; None: never).

    Attributes:
        stall: Every rank waiting, with nothing moving, for this long ends the run.
        grace: After a SIGTERM, this replaces ``stall`` when it is shorter.
    """

    stall: float | None
    grace: float | None

    def window(self, stopping: bool) -> float | None:
        options = [v for v in (self.stall, self.grace if stopping else None) if v is not None]
        return min(options) if options else None

    @property
    def interval(self) -> float:
        """How often to look: a quarter of the shortest limit, at most every 2 s."""
        shortest = min(v for v in (self.stall, self.grace) if v is not None)
        return min(2.0, max(0.05, shortest / 4))

    @property
    def active(self) -> bool:
        return self.stall is not None or self.grace is not None


@dataclass(frozen=True)
class Diagnosis:
    """Why the watchdog ended the run, and where every rank was.

    Attributes:
        headline: One paragraph: what was found, after how long, and the setting that
            governs it.
        waits: What each rank waits in, by global rank.
        stack: Global rank 0's main-thread stack at the time.
    """

    headline: str
    waits: dict[int, str]
    stack: str

    def text(self) -> str:
        lines = [self.headline] + [f"  rank {rank}: waits in {where}" for rank, where in sorted(self.waits.items())]
        ended = [where.startswith(JOIN_BLOCK_END) for where in self.waits.values()]
        if any(ended) and not all(ended):
            lines.append(
                "A rank waiting at the end of lite.join while others are still in their steps left "
                "its loop early on its own (a `break` decided from this rank's numbers, an early "
                "stop). Decide it together, then break on every rank: `stop = "
                "lite.all_reduce(torch.tensor(float(stop)), op='max') > 0`."
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"headline": self.headline, "waits": {str(k): v for k, v in self.waits.items()}})

    @classmethod
    def from_json(cls, text: str) -> Diagnosis:
        data = json.loads(text)
        return cls(data["headline"], {int(k): v for k, v in data["waits"].items()}, "")


class HangWatchdog:
    """One rank's watchdog thread (see the module docstring), watching the thread that
    creates it: the one that runs the launch block.

    Args:
        rank: This process's global rank.
        world_size: The number of ranks.
        store: The run's store, shared by every rank (keys go under ``prefix``).
        prefix: Keys of this launch block (a store may outlive a block: torchrun's agent's).
        limits: When to end the run.
        stop_seen: Whether this process was asked to stop (SIGTERM), also while the main
            thread is blocked in C code.
        end_run: On rank 0 of a run we started: what ends the run (the supervisor). None
            where each rank must end itself (``exits_itself``) or waits to be ended.
        exits_itself: Whether this rank leaves the process itself on the verdict (a world
            someone else started).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        prefix: str,
        limits: Limits,
        stop_seen: Callable[[], bool],
        end_run: Callable[[Diagnosis], None] | None = None,
        exits_itself: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.prefix = prefix
        self.limits = limits
        self.stop_seen = stop_seen
        self.end_run = end_run
        self.exits_itself = exits_itself
        self.progress = Progress(group_sequence_numbers, bytes_written)
        self._published: tuple[int, str | None, bool] | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (episode, first seen), rank 0 only
        self._suspect = False  # the last look found a stall too (rank 0)
        self._watched = threading.get_ident()  # the thread that runs the block
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scopedlite-hang-watchdog", daemon=True)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (the block is over); safe to call more than once."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.wait(self.limits.interval):
                self._tick()
        except Exception:  # noqa: BLE001 - the store went away: the run is ending anyway
            return

    def _tick(self) -> None:
        look = look_at(frame_of(self._watched))
        state = (self.progress.update(look), look.where, bool(self.stop_seen()))
        if state != self._published:
            episode, where, stop = state
            self.store.set(self._key(f"rank/{self.rank}"), json.dumps([episode, where, stop]))
            self._published = state
        if self.rank == 0:
            self._decide()
        elif self.exits_itself and self.store.check([self._key("verdict")]):
            self._follow(Diagnosis.from_json(self.store.get(self._key("verdict")).decode()))

    def _decide(self) -> None:
        keys = [self._key(f"rank/{r}") for r in range(self.world_size)]
        if not self.store.check(keys):
            return  # a rank has not looked yet
        states = [json.loads(v) for v in self.store.multi_get(keys)]
        now = time.monotonic()
        for rank, (episode, _, _) in enumerate(states):
            if self._seen.get(rank, (None, 0.0))[0] != episode:
                self._seen[rank] = (episode, now)
        stopping = any(stop for _, _, stop in states)
        window = self.limits.window(stopping)
        waited = min(now - since for _, since in self._seen.values())
        stalled = window is not None and all(where for _, where, _ in states) and waited >= window
        if stalled and self._suspect:
            self._end(
                Diagnosis(
                    self._headline(waited, stopping, window),
                    {r: s[1] for r, s in enumerate(states)},
                    format_stack_of(self._watched),
                )
            )
        self._suspect = stalled

    def _headline(self, waited: float, stopping: bool, window: float) -> str:
        if stopping and (self.limits.stall is None or window < self.limits.stall):
            return (
                f"A SIGTERM asked the run to stop, but it cannot reach a stop: every rank has waited "
                f"for the others for {waited:.0f} s and nothing moved (a collective that never "
                f"completes), so the run was ended (grace after a SIGTERM: {window:g} s, "
                f"SCOPEDLITE_TERM_GRACE). Where every rank waits (a rank not in the same "
                "collective as the others skipped it or called another one):"
            )
        return (
            f"No rank moved for {waited:.0f} s: every rank waits for the others (stall window "
            f"{window:g} s, SCOPEDLITE_HANG_TIMEOUT), so the ranks are out of step: one skipped a "
            "collective the others are in, or called another one. Where every rank waits:"
        )

    # -- ending ----------------------------------------------------------------------------
    def _end(self, diagnosis: Diagnosis) -> None:
        if self.end_run is not None:
            self.end_run(diagnosis)
            for _ in range(6):  # a loaded machine may take a while to unwind: not while it moves
                if self._stopped.wait(END_WAIT_S):
                    return  # the launch took it from there
                if look_at(frame_of(self._watched)).waiting:
                    break
        else:
            self.store.set(self._key("verdict"), diagnosis.to_json())
            deadline = time.monotonic() + END_WAIT_S / 2
            while (
                self.exits_itself
                and self.store.add(self._key("reported"), 0) < self.world_size - 1
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
        _leave(f"{diagnosis.text()}\n--- rank {self.rank} (this process) ---\n{diagnosis.stack}", self.rank)

    def _follow(self, diagnosis: Diagnosis) -> None:
        where = diagnosis.waits.get(self.rank)
        stack = format_stack_of(self._watched)
        report = f"{diagnosis.text()}\n--- rank {self.rank} (this process), waiting in {where} ---\n{stack}"
        try:
            sys.stderr.write(_prefixed(report, self.rank) + "\n")
            sys.stderr.flush()
        finally:
            try:
                self.store.add(self._key("reported"), 1)
            finally:
                os._exit(_EXIT_CODE)


def _prefixed(text: str, rank: int) -> str:
    return "\n".join(f"[scopedlite rank {rank}] {line}" for line in text.splitlines())


def _leave(report: str, rank: int) -> None:
    """Print ``report`` to stderr and end the process now: the main thread cannot be reached."""
    try:
        sys.stderr.write(_prefixed(report, rank) + "\n")
        sys.stderr.flush()
    finally:
        os._exit(_EXIT_CODE)
