"""The join session's wire message: what each rank says at the start of a round.

Every round of ``lite.join``'s protocol opens with an all-gather of one :class:`Opener` per
rank, so every rank reads what every other rank is about to do, and all of them reach the
same verdict from the same rows (:class:`Round`). The message is a fixed-size float64
vector: integers up to 2**53 travel exactly, and it encodes and decodes itself.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from scopedlite._comm.wire import DTYPES, MAX_DIMS
from scopedlite._strategies.base import REDUCE_OPS

__all__ = [
    "Action",
    "BARRIER",
    "BROADCAST",
    "Event",
    "GATHER",
    "Header",
    "Kind",
    "Opener",
    "REDUCE",
    "Round",
    "LENGTH",
    "MAX_EVENTS",
]

REDUCE, GATHER, BROADCAST, BARRIER = 1, 2, 3, 4  # which of our collectives a Header describes


class Kind(IntEnum):
    """What a rank does next."""

    LEFT = 0  # out of the block: it serves the others until every rank is
    FORWARD = 1  # a forward of model ``index``
    BACKWARD = 2  # the backward of forward ``seq`` of model ``index``
    STEP = 3  # a collective optimizer step (DeepSpeed)
    CLIP = 4  # lite.clip_gradients
    COLLECTIVE = 5  # one of our collectives (its header travels with it)
    PASS = 6  # a pass over a loader from setup_dataloader begins
    ABORT = 7  # this rank leaves the block by an exception
    EVENTS = 8  # only events: more than one opener carries


class Action(IntEnum):
    """A local action with no collective of its own, replayed by the ranks that serve."""

    OPTIMIZER_STEP = 1  # value: the sum of the optimizer's learning rates
    ZERO_GRAD = 2  # value: 1 for set_to_none=True
    SCHEDULER_STEP = 3
    MODULE_ZERO_GRAD = 4  # value: 1 for set_to_none=True


@dataclass(frozen=True)
class Event:
    action: Action
    index: int  # which optimizer, scheduler or model
    value: float = 0.0

    def describe(self) -> str:
        what = {
            Action.OPTIMIZER_STEP: "optimizer.step()",
            Action.ZERO_GRAD: "optimizer.zero_grad()",
            Action.SCHEDULER_STEP: "scheduler.step()",
            Action.MODULE_ZERO_GRAD: "model.zero_grad()",
        }[self.action]
        return f"{what} (#{self.index})"


@dataclass(frozen=True)
class Header:
    """What one of our collectives carries: enough for a serving rank to take part."""

    collective: int = 0  # REDUCE, GATHER, BROADCAST or BARRIER
    op: int = 0  # index into collectives.OPS
    dtype: int = 0  # index into wire.DTYPES
    shape: tuple[int, ...] = ()
    src: int = 0
    payload: int = 0  # BROADCAST: 1 a tensor, 2 pickled bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        """``lite.all_gather of float32[3]``: the call, as a refusal shows it."""
        name = _COLLECTIVE_NAMES.get(self.collective, "a lite collective")
        if self.collective in (REDUCE, GATHER):
            op = f"(op={REDUCE_OPS[self.op]!r})" if self.collective == REDUCE else ""
            dtype = str(self.torch_dtype).removeprefix("torch.")
            return f"{name}{op} of {dtype}[{', '.join(map(str, self.shape))}]"
        return f"{name}(src={self.src})" if self.collective == BROADCAST else name


_COLLECTIVE_NAMES = {
    REDUCE: "lite.all_reduce",
    GATHER: "lite.all_gather",
    BROADCAST: "lite.broadcast",
    BARRIER: "lite.barrier",
}
MAX_EVENTS = 6  # events carried by one opener; more open rounds of their own
_FIXED = 13  # kind ... length (10 integers), then the 3 values
_VALUES_AT = 10
_HEADER_AT = _FIXED  # collective, op, dtype, src, payload, ndim, shape...
_EVENTS_AT = _HEADER_AT + 6 + MAX_DIMS
LENGTH = _EVENTS_AT + 1 + 3 * MAX_EVENTS


@dataclass(frozen=True)
class Opener:
    """One rank's announcement (see the module docstring)."""

    kind: Kind
    site: int = 0  # where: a collective's call site, a pass's loader
    index: int = 0  # which model (or optimizer)
    flag: int = 0  # FORWARD: grad mode | sync << 1 | buffers << 2; BACKWARD: sync
    mask: int = 0  # BACKWARD: which outputs received a gradient
    seq: int = 0  # BACKWARD: which forward
    ended: int = 0  # passes of set-up loaders this rank finished inside the block
    reports: bool = False  # ``events`` are what this rank ran itself since its last round
    needs: int = 0  # bit m: this rank has no input of model m to replay with
    length: int = -1  # PASS: this rank's batches in the pass (-1: not known)
    values: tuple[float, float, float] = (0.0, 0.0, 0.0)
    header: Header = field(default_factory=Header)
    events: tuple[Event, ...] = ()

    def encode(self) -> list[float]:
        row = [0.0] * LENGTH
        row[:_FIXED] = [
            self.kind,
            self.site,
            self.index,
            self.flag,
            self.mask,
            self.seq,
            self.ended,
            self.reports,
            self.needs,
            self.length,
            *self.values,
        ]
        h = self.header
        row[_HEADER_AT : _HEADER_AT + 6] = [h.collective, h.op, h.dtype, h.src, h.payload, len(h.shape)]
        row[_HEADER_AT + 6 : _HEADER_AT + 6 + len(h.shape)] = h.shape
        row[_EVENTS_AT] = len(self.events)
        for k, event in enumerate(self.events):
            row[_EVENTS_AT + 1 + 3 * k : _EVENTS_AT + 4 + 3 * k] = [event.action, event.index, event.value]
        return row

    @classmethod
    def decode(cls, row: list[float]) -> Opener:
        i = [0 if _VALUES_AT <= k < _FIXED else round(v) for k, v in enumerate(row[: _EVENTS_AT + 1])]
        h = i[_HEADER_AT : _HEADER_AT + 6]
        header = Header(h[0], h[1], h[2], tuple(i[_HEADER_AT + 6 : _HEADER_AT + 6 + h[5]]), h[3], h[4])
        events = tuple(
            Event(
                Action(round(row[_EVENTS_AT + 1 + 3 * k])),
                round(row[_EVENTS_AT + 2 + 3 * k]),
                row[_EVENTS_AT + 3 + 3 * k],
            )
            for k in range(i[_EVENTS_AT])
        )
        return cls(
            Kind(i[0]),
            i[1],
            i[2],
            i[3],
            i[4],
            i[5],
            i[6],
            bool(i[7]),
            i[8],
            i[9],
            (row[_VALUES_AT], row[_VALUES_AT + 1], row[_VALUES_AT + 2]),
            header,
            events,
        )

    def step_key(self) -> tuple[object, ...]:
        """What ranks doing the same step announce alike (not their own bookkeeping)."""
        return (self.kind, self.site, self.index, self.flag, self.mask, self.seq, self.values, self._header_key())

    def _header_key(self) -> tuple[object, ...]:
        if self.kind != Kind.COLLECTIVE:
            return ()
        h = self.header
        return (h.collective, h.src) if h.collective == BROADCAST else (h.collective, h.op, h.dtype, h.shape)

    def with_events(self, events: tuple[Event, ...], reports: bool, ended: int, needs: int = 0) -> Opener:
        return dataclasses.replace(self, events=events, reports=reports, ended=ended, needs=needs)

    def describe(self) -> str:
        if self.kind == Kind.FORWARD:
            return f"a forward of model {self.index}"
        if self.kind == Kind.BACKWARD:
            return f"a backward of model {self.index}"
        if self.kind == Kind.COLLECTIVE:
            return f"{self.header.describe()} at {site_name(self.site)}"
        if self.kind == Kind.PASS:
            return f"a new pass over a loader at {site_name(self.site)}"
        return {
            Kind.LEFT: "the end of the block",
            Kind.STEP: f"optimizer step of model {self.index}",
            Kind.CLIP: "lite.clip_gradients",
            Kind.ABORT: "an exception",
            Kind.EVENTS: "optimizer/scheduler calls",
        }[self.kind]


# Call sites travel as small integers; each rank keeps the names of the ones it saw.
_SITE_NAMES: dict[int, str] = {}


def site_id(name: str) -> int:
    """A stable integer for a call site ``file:line`` (the same on every rank)."""
    value = zlib.crc32(name.encode()) & 0x7FFFFFFF
    _SITE_NAMES.setdefault(value, name)
    return value


def site_name(value: int) -> str:
    return _SITE_NAMES.get(value, f"site #{value}")


class Round:
    """The openers of every rank in one round, and what they decide."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.openers = [Opener.decode(row) for row in rows]
        self.aborted = any(o.kind == Kind.ABORT for o in self.openers)
        alive = [r for r, o in enumerate(self.openers) if o.kind != Kind.LEFT]
        self.alive = alive
        lowest = min((self.openers[r].ended for r in alive), default=0)
        # Ranks that finished more loader passes than others are past the point the others
        # are at: they wait (serving) until the others catch up.
        self.runners = [r for r in alive if self.openers[r].ended == lowest]
        self.waiters = [r for r in alive if self.openers[r].ended != lowest]

    @property
    def over(self) -> bool:
        return not self.alive

    @property
    def step(self) -> Opener:
        """The announcement the runners agreed on."""
        return self.openers[self.runners[0]]

    def _same_collective_other_tensors(self) -> bool:
        """Every running rank is in the same reduce or gather, from the same line, but with
        another tensor (shape or dtype)."""
        openers = [self.openers[r] for r in self.runners]
        calls = {(o.kind, o.site, o.header.collective, o.header.op) for o in openers}
        return (
            len(calls) == 1 and openers[0].kind == Kind.COLLECTIVE and openers[0].header.collective in (REDUCE, GATHER)
        )

    def disagreement(self) -> str | None:
        """Why this round cannot go on, or None."""
        keys = {self.openers[r].step_key() for r in self.runners}
        if len(keys) > 1 and self._same_collective_other_tensors():
            described = "\n".join(f"  rank {r}: {self.openers[r].describe()}" for r in self.runners)
            return (
                "Inside lite.join the ranks still active called the same collective with tensors "
                "of different shapes or dtypes, so they cannot exchange them (torch.distributed "
                f"would deliver made-up values or abort the process):\n{described}\n"
                "Pass tensors of one shape and dtype on every rank (pad them; per-rank totals "
                "for a reduction), or use lite.gather_for_metrics(x) for per-rank rows of "
                "different lengths."
            )
        if len(keys) > 1:
            described = "; ".join(f"rank {r}: {self.openers[r].describe()}" for r in self.runners)
            after_loop = any(self.openers[r].kind == Kind.COLLECTIVE for r in self.runners)
            return (
                "Inside lite.join the ranks still active announced different steps "
                f"({described}). Every active rank must run the same sequence of forwards, "
                "backwards, optimizer steps and lite collectives, each collective called from "
                "the same line; data-dependent control flow that differs between ranks cannot "
                "be joined."
                + (
                    " A collective after the loop inside the block waits for the other ranks "
                    "only when the loop runs over a loader from lite.setup_dataloader (so the "
                    "session knows this rank ran out of data); otherwise call it after the "
                    "`with lite.join(...)` block."
                    if after_loop
                    else ""
                )
            )
        for r in self.waiters:
            if self.openers[r].kind not in (Kind.COLLECTIVE, Kind.PASS):
                return (
                    f"Inside lite.join rank {r} finished its pass over the loader and then ran "
                    f"{self.openers[r].describe()} while rank(s) {', '.join(map(str, self.runners))} "
                    f"still iterate ({self.step.describe()}). After its loop a rank may call lite "
                    "collectives (it waits for the others there) or leave the block; run "
                    "anything else after the `with lite.join(...)` block."
                )
        return None

    def replica_problem(self, replicas: tuple[int, ...]) -> str | None:
        """Why the ranks of one data-parallel replica (``replicas[r]``: rank ``r``'s) are not
        in step, or None.

        Under ``model_parallel`` the tensor-parallel ranks of a replica compute one model
        together: they read the same batches, so they run, wait and leave together, announcing
        the same things. One of them serving while another computes would pair its replay's
        collectives with the other's own.
        """
        seen: dict[int, tuple[int, tuple[object, ...]]] = {}
        for r, replica in enumerate(replicas):
            mine = self._state(r)
            first = seen.setdefault(replica, (r, mine))
            if mine != first[1]:
                ranks = [q for q, p in enumerate(replicas) if p == replica]
                described = "; ".join(f"rank {q}: {self._doing(q)}" for q in ranks)
                return (
                    f"Inside lite.join the ranks of data-parallel replica {replica} (ranks "
                    f"{', '.join(map(str, ranks))}) are not in step ({described}). The "
                    "tensor-parallel ranks of a replica compute one model together: they must "
                    "read the same batches and run the same steps, so that they run out of data "
                    "together. Iterate over a loader from lite.setup_dataloader (it gives them "
                    "the same batches), with the same code on each."
                )
        return None

    def _state(self, rank: int) -> tuple[object, ...]:
        opener = self.openers[rank]
        if opener.kind == Kind.LEFT:
            return (Kind.LEFT,)
        return (rank in self.runners, opener.step_key(), opener.length)

    def _doing(self, rank: int) -> str:
        opener = self.openers[rank]
        if opener.kind == Kind.LEFT:
            return "left the block"
        what = opener.describe() + (
            f" of {opener.length} batches" if opener.kind == Kind.PASS and opener.length >= 0 else ""
        )
        return what if rank in self.runners else f"waits at {what}"

    def events_problem(self) -> str | None:
        """Why the events reported in this round do not fit together, or None.

        The ranks that ran since the last round report the same list; a rank that stopped
        running since its last round reports what it did before it stopped: the start of it.
        """
        reference = self.reference_events()
        lists = {r: o.events for r, o in enumerate(self.openers) if o.reports}
        fits = all(
            events == reference if r in self.runners else events == reference[: len(events)]
            for r, events in lists.items()
        )
        if fits:
            return None
        described = "; ".join(
            f"rank {r}: {', '.join(e.describe() for e in ev) or 'nothing'}" for r, ev in lists.items()
        )
        return (
            "Inside lite.join the ranks did different optimizer/scheduler calls between the "
            f"same two points ({described}). The usual cause is an LR scheduler (or zero_grad) "
            "called after the loop but inside the join block: it then runs at different "
            "times on different ranks. Call it after the `with lite.join(...)` block."
        )

    def reference_events(self) -> tuple[Event, ...]:
        """What the ranks that ran since the last round did."""
        return max((o.events for o in self.openers if o.reports), key=len, default=())

    def events_to_apply(self, rank: int) -> tuple[Event, ...]:
        """The events rank ``rank`` replays: those it did not do itself."""
        mine = self.openers[rank]
        if mine.reports and rank in self.runners:
            return ()
        reference = self.reference_events()
        return reference[len(mine.events) :] if mine.reports else reference

    def authoritative(self) -> int:
        """The highest of the ranks that ran last (torch's last joiner)."""
        reporting = [r for r, o in enumerate(self.openers) if o.reports]
        return max(reporting) if reporting else len(self.openers) - 1
