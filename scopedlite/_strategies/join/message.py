"""The join session's wire message: what each rank says at the start of a round.

Every round of ``lite.join``'s protocol opens with an all-gather of one :class:`Step` per
rank, so every rank reads what every other rank is about to do, and all of them reach the
same verdict from the same rows (:class:`Round`). The message is a fixed-size float64
vector: integers up to 2**53 travel exactly, and it encodes and decodes itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable

import torch

from scopedlite._comm.debug import site_name
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
    "REDUCE",
    "Round",
    "Step",
    "LENGTH",
    "MAX_EVENTS",
]

REDUCE, GATHER, BROADCAST, BARRIER = 1, 2, 3, 4  # which of our collectives a Header describes


class Kind(IntEnum):
    """What a rank does next."""

    LEFT = 0  # out of the block: it serves the others until every rank is
    FORWARD = 1  # forward ``seq`` of model ``index``
    BACKWARD = 2  # the backward of forward ``seq`` of model ``index``
    STEP = 3  # a collective optimizer step (DeepSpeed)
    CLIP = 4  # lite.clip_gradients
    COLLECTIVE = 5  # one of our collectives (its header travels with it)
    PASS = 6  # a pass over a loader from setup_dataloader begins
    ABORT = 7  # this rank leaves the block by an exception
    EVENTS = 8  # only events: more than one said carries


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
MAX_EVENTS = 6  # events carried by one step message; more open rounds of their own
_OWN = {"own": True}  # a field of a rank's own bookkeeping, not of the step the ranks agree on


@dataclass(frozen=True)
class Step:
    """One rank's message at the start of a round: what it does next (see the module docstring).

    Each field has one meaning; those of the step itself are what ranks doing the same step
    announce alike (:meth:`key`), those marked own are each rank's bookkeeping. It encodes to
    a fixed-size float64 row, field by field in declaration order (``None`` as NaN), then the
    collective's header, then the events.
    """

    kind: Kind
    site: int = 0  # where: a collective's call site, a pass's loader
    model: int = 0  # FORWARD, BACKWARD, STEP, CLIP: which model of the block
    optimizer: int = 0  # CLIP: which optimizer of the block
    grad: bool = False  # FORWARD: under torch.is_grad_enabled()
    sync: bool = False  # FORWARD, BACKWARD: the backward synchronises gradients
    buffers: bool = False  # FORWARD: DDP broadcasts the buffers first
    mask: int = 0  # BACKWARD: which outputs received a gradient
    seq: int = 0  # FORWARD: its number (the same on every rank); BACKWARD: which forward
    lr: float = 0.0  # STEP: the sum of the optimizer's learning rates
    max_norm: float | None = None  # CLIP
    clip_val: float | None = None  # CLIP
    norm_type: float = 2.0  # CLIP
    ended: int = field(default=0, metadata=_OWN)  # passes of set-up loaders finished inside the block
    reports: bool = field(default=False, metadata=_OWN)  # ``events``: what this rank ran since its last round
    needs: int = field(default=0, metadata=_OWN)  # bit m: this rank has no input of model m to replay with
    length: int = field(default=-1, metadata=_OWN)  # PASS: this rank's batches in the pass (-1: not known)
    scheduler_steps: int = field(default=0, metadata=_OWN)  # LEFT: how often its schedulers stepped
    posted: bool = field(default=False, metadata=_OWN)  # the sender went on without waiting for this round
    holding: bool = field(default=False, metadata=_OWN)  # BACKWARD: the sender held gradients it reduces again (DDP)
    header: Header = field(default_factory=Header)  # COLLECTIVE
    events: tuple[Event, ...] = field(default=(), metadata=_OWN)

    def encode(self) -> list[float]:
        row = [_to_float(getattr(self, f.name)) for f in _SCALARS]
        h = self.header
        row += [h.collective, h.op, h.dtype, h.src, h.payload, len(h.shape), *h.shape]
        row += [0.0] * (_EVENTS_AT - len(row)) + [len(self.events)]
        for event in self.events:
            row += [event.action, event.index, event.value]
        return row + [0.0] * (LENGTH - len(row))

    @classmethod
    def decode(cls, row: list[float]) -> Step:
        scalars = {f.name: _FROM_FLOAT[f.type](v) for f, v in zip(_SCALARS, row)}
        h = [round(v) for v in row[_HEADER_AT : _HEADER_AT + 6]]
        shape = tuple(round(v) for v in row[_HEADER_AT + 6 : _HEADER_AT + 6 + h[5]])
        header = Header(collective=h[0], op=h[1], dtype=h[2], shape=shape, src=h[3], payload=h[4])
        at = _EVENTS_AT + 1
        events = tuple(
            Event(Action(round(row[k])), round(row[k + 1]), row[k + 2])
            for k in range(at, at + 3 * round(row[_EVENTS_AT]), 3)
        )
        return cls(**scalars, header=header, events=events)

    def key(self) -> tuple[object, ...]:
        """What ranks doing the same step announce alike (not their own bookkeeping)."""
        return (*(getattr(self, f.name) for f in _SCALARS if not f.metadata), self._header_key())

    def same_forward(self, other: Step) -> bool:
        """Whether both are backwards of the same forward (of the same model)."""
        return self.kind == other.kind == Kind.BACKWARD and (self.model, self.seq) == (other.model, other.seq)

    def _header_key(self) -> tuple[object, ...]:
        if self.kind != Kind.COLLECTIVE:
            return ()
        h = self.header
        return (h.collective, h.src) if h.collective == BROADCAST else (h.collective, h.op, h.dtype, h.shape)

    def with_events(self, events: tuple[Event, ...], reports: bool, ended: int, needs: int = 0) -> Step:
        return dataclasses.replace(self, events=events, reports=reports, ended=ended, needs=needs)

    def describe(self) -> str:
        if self.kind == Kind.FORWARD:
            how = " without gradients" if not self.grad else " inside no_backward_sync" if not self.sync else ""
            return f"forward #{self.seq} of model {self.model}{how}"
        if self.kind == Kind.BACKWARD:
            how = "" if self.sync else " inside no_backward_sync"
            return f"the backward of forward #{self.seq} of model {self.model}{how}"
        if self.kind == Kind.COLLECTIVE:
            return f"{self.header.describe()} at {site_name(self.site)}"
        if self.kind == Kind.PASS:
            return f"a new pass over a loader at {site_name(self.site)}"
        return {
            Kind.LEFT: "the end of the block",
            Kind.STEP: f"optimizer step of model {self.model}",
            Kind.CLIP: "lite.clip_gradients",
            Kind.ABORT: "an exception",
            Kind.EVENTS: "optimizer/scheduler calls",
        }[self.kind]


def _to_float(value: object) -> float:
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


# How each scalar field comes back from its float (the annotations are strings here).
_FROM_FLOAT: dict[object, Callable[[float], object]] = {
    "Kind": lambda v: Kind(round(v)),
    "int": round,
    "bool": lambda v: bool(round(v)),
    "float": float,
    "float | None": lambda v: None if math.isnan(v) else v,
}
_SCALARS = [f for f in dataclasses.fields(Step) if f.type in _FROM_FLOAT]
_HEADER_AT = len(_SCALARS)  # collective, op, dtype, src, payload, ndim, shape...
_EVENTS_AT = _HEADER_AT + 6 + MAX_DIMS  # the count, then (action, index, value) each
LENGTH = _EVENTS_AT + 1 + 3 * MAX_EVENTS


class Round:
    """The step messages of every rank in one round, and what they decide."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.steps = [Step.decode(row) for row in rows]
        self.aborted = any(o.kind == Kind.ABORT for o in self.steps)
        alive = [r for r, o in enumerate(self.steps) if o.kind != Kind.LEFT]
        self.alive = alive
        lowest = min((self.steps[r].ended for r in alive), default=0)
        # Ranks that finished more loader passes than others are past the point the others
        # are at: they wait (serving) until the others catch up.
        self.runners = [r for r in alive if self.steps[r].ended == lowest]
        self.waiters = [r for r in alive if self.steps[r].ended != lowest]

    @property
    def over(self) -> bool:
        return not self.alive

    @property
    def step(self) -> Step:
        """The announcement the runners agreed on."""
        return self.steps[self.runners[0]]

    def _same_collective_other_tensors(self) -> bool:
        """Every running rank is in the same reduce or gather, from the same line, but with
        another tensor (shape or dtype)."""
        said = [self.steps[r] for r in self.runners]
        calls = {(o.kind, o.site, o.header.collective, o.header.op) for o in said}
        return len(calls) == 1 and said[0].kind == Kind.COLLECTIVE and said[0].header.collective in (REDUCE, GATHER)

    def disagreement(self) -> str | None:
        """Why this round cannot go on, or None."""
        keys = {self.steps[r].key() for r in self.runners}
        if len(keys) > 1 and self._same_collective_other_tensors():
            described = "\n".join(f"  rank {r}: {self.steps[r].describe()}" for r in self.runners)
            return (
                "Inside lite.join the ranks still active called the same collective with tensors "
                "of different shapes or dtypes, so they cannot exchange them (torch.distributed "
                f"would deliver made-up values or abort the process):\n{described}\n"
                "Pass tensors of one shape and dtype on every rank (pad them; per-rank totals "
                "for a reduction), or use lite.gather_for_metrics(x) for per-rank rows of "
                "different lengths."
            )
        if len(keys) > 1:
            described = "; ".join(f"rank {r}: {self.steps[r].describe()}" for r in self.runners)
            return (
                "Inside lite.join the ranks still active announced different steps "
                f"({described}). Every active rank must run the same sequence of forwards, "
                "backwards, optimizer steps and lite collectives, each collective called from "
                "the same line; data-dependent control flow that differs between ranks cannot "
                "be joined." + self._hint()
            )
        for r in self.waiters:
            if self.steps[r].kind not in (Kind.COLLECTIVE, Kind.PASS):
                return (
                    f"Inside lite.join rank {r} finished its pass over the loader and then ran "
                    f"{self.steps[r].describe()} while rank(s) {', '.join(map(str, self.runners))} "
                    f"still iterate ({self.step.describe()}). After its loop a rank may call lite "
                    "collectives (it waits for the others there) or leave the block; run "
                    "anything else after the `with lite.join(...)` block."
                )
        return None

    def _hint(self) -> str:
        """The likely cause of a disagreement, and its fix."""
        said = [self.steps[r] for r in self.runners]
        if len({dataclasses.replace(o, sync=False).key() for o in said}) == 1:
            return (
                " The ranks disagree on synchronising gradients (lite.no_backward_sync): an "
                "accumulation window ended at each rank's own last batch (`i == len(loader) - "
                "1`) ends at different steps inside lite.join. End windows by the step count "
                "alone (`(i + 1) % n == 0`), the same on every rank: what a rank accumulated "
                "before it ran out is contributed at the others' next synchronising backward."
            )
        passes = all(o.kind in (Kind.FORWARD, Kind.BACKWARD) for o in said)
        if passes and len({o.model for o in said}) == 1 and len({o.seq for o in said}) > 1:
            return (
                " One rank ran more forwards of the model than another: a step skipped on some "
                "ranks only (`if not torch.isfinite(loss): continue`, an exception caught on "
                "one rank) or a forward on one rank alone. Decide a skip on every rank together: "
                '`skip = lite.all_reduce(float(not ok), op="max") > 0`, then `continue` '
                "everywhere; evaluate after the block, or on every rank."
            )
        if any(o.kind == Kind.COLLECTIVE for o in said):
            return (
                " A collective on a rank's last batch (an end-of-epoch log keyed on `i == "
                "len(loader) - 1`, which comes at a different batch on each rank inside "
                "lite.join) belongs after the loop. A collective after the loop inside the "
                "block waits for the other ranks only when the loop runs over a loader from "
                "lite.setup_dataloader (so the session knows this rank ran out of data); "
                "otherwise call it after the `with lite.join(...)` block."
            )
        return ""

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
        said = self.steps[rank]
        if said.kind == Kind.LEFT:
            return (Kind.LEFT,)
        return (rank in self.runners, said.key(), said.length)

    def _doing(self, rank: int) -> str:
        said = self.steps[rank]
        if said.kind == Kind.LEFT:
            return "left the block"
        what = said.describe() + (f" of {said.length} batches" if said.kind == Kind.PASS and said.length >= 0 else "")
        return what if rank in self.runners else f"waits at {what}"

    def events_problem(self) -> str | None:
        """Why the events reported in this round do not fit together, or None.

        The ranks that ran since the last round report the same list; a rank that stopped
        running since its last round reports what it did before it stopped: the start of it.
        """
        reference = self.reference_events()
        lists = {r: o.events for r, o in enumerate(self.steps) if o.reports}
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
        return max((o.events for o in self.steps if o.reports), key=len, default=())

    def events_to_apply(self, rank: int) -> tuple[Event, ...]:
        """The events rank ``rank`` replays: those it did not do itself."""
        mine = self.steps[rank]
        if mine.reports and rank in self.runners:
            return ()
        reference = self.reference_events()
        return reference[len(mine.events) :] if mine.reports else reference

    def authoritative(self) -> int:
        """The highest of the ranks that ran last (torch's last joiner)."""
        reporting = [r for r, o in enumerate(self.steps) if o.reports]
        return max(reporting) if reporting else len(self.steps) - 1
